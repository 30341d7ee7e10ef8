# How much of ctest's -j budget each multi-process test takes (the PROCESSORS property), in halves of
# a core: scripts/test.sh runs `ctest -j<2 x cores + 1>` (-j5 on the 2-core machine), and a test
# counts ceil(2 x its cores), between 1 and 4, its cores measured alone (cmake/test_costs.cmake,
# scripts/update_test_costs.py: CPU time of the test and everything it waited for over its wall
# time). So a test that waits out deadlines and heartbeats (launchers, stores, stall watchdogs:
# under 0.5 of a core) counts 1 and runs beside anything, two tests that each keep one core busy run
# together, and a test that computes on both cores runs beside waiting tests only.
# A test not in the table counts 4: a new test runs beside waiting tests only until it is measured.
# The single-process tests (label `unit`) run in their own phase and keep the default of 1.
#
# Each test's measured seconds are also its COST: ctest -j starts the long tests first, where a
# fresh clone would otherwise start them in registration order.
include(${CMAKE_CURRENT_LIST_DIR}/test_costs.cmake)

# Sets PROCESSORS on every test the calling folder's CMakeLists.txt registered, as above, and COST
# from the table; each folder that registers tests calls it at its end (CMake 3.25 sets test
# properties only from the folder that added the test).
function(dtrain_weigh_tests)
  get_property(tests DIRECTORY PROPERTY TESTS)
  foreach(test IN LISTS tests)
    get_test_property(${test} LABELS labels)
    set(halves 4)
    list(FIND DTRAIN_TEST_COSTS ${test} at)
    if(at GREATER_EQUAL 0)
      math(EXPR at_cores "${at} + 2")
      math(EXPR at "${at} + 1")
      list(GET DTRAIN_TEST_COSTS ${at} seconds)
      list(GET DTRAIN_TEST_COSTS ${at_cores} cores)
      set_tests_properties(${test} PROPERTIES COST ${seconds})
      # ceil(2 x cores) in CMake's integer arithmetic: cores has two decimals
      string(REPLACE "." "" hundredths ${cores})
      string(REGEX REPLACE "^0+([0-9])" "\\1" hundredths ${hundredths})  # not read as octal
      math(EXPR halves "(2 * ${hundredths} + 99) / 100")
      if(halves LESS 1)
        set(halves 1)
      elseif(halves GREATER 4)
        set(halves 4)
      endif()
    endif()
    if(labels AND "unit" IN_LIST labels)
      continue()
    endif()
    set_tests_properties(${test} PROPERTIES PROCESSORS ${halves})
  endforeach()
endfunction()
