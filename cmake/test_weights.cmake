# How many cores each multi-process test takes from ctest's -j budget (the PROCESSORS property), so
# that scripts/test.sh can run `ctest -j3` on a 2-core machine: a test that computes (ranks training,
# collectives) counts 2 and never runs beside another such test, while a test that mostly waits
# (timeouts, heartbeats, a rendezvous that must expire) counts 1 and runs beside one of them.
#
# The waiting tests are named here, each for the reason its time goes to waiting. The measure: CPU
# time of the test and everything it waited for, against its wall time, the test alone on the
# machine; these spend under half of their wall time on a core (docs/benchmarks.md, "Slowest tests").
# A test not named counts 2, whatever it is: a new test runs alone until someone measures it.
# The single-process tests (label `unit`) run in their own phase and keep the default of 1.
set(DTRAIN_WAITING_TESTS
  # shell and Python one-liners under the real launcher: its timeouts, restarts, heartbeats and
  # rendezvous deadlines are what these tests watch
  launcher_env launcher_output launcher_progress_bar launcher_failure launcher_usage launcher_multinode
  launcher_restart launcher_slurm_step launcher_elastic launcher_elastic_threads launcher_cluster launcher_rdzv_conf
  # stores, rendezvous and launchers refusing bad clients and waiting out their deadlines
  dist_py_security dist_py_init_methods
  # a rank's timeout breaks the group: the others wait for it
  dist_broken_group_test_2 dist_broken_group_test_3
  # ranks wait out 5-s collective timeouts and stall watchdogs (36 s wall, 12.5 s CPU, measured)
  dist_py_flight_recorder)

# Each slow test's measured seconds (scripts/update_test_costs.py), set as its COST: ctest -j starts
# the long tests first, where a fresh clone would otherwise start them in registration order.
include(${CMAKE_CURRENT_LIST_DIR}/test_costs.cmake)

# Sets PROCESSORS on every test the calling folder's CMakeLists.txt registered, as above, and COST
# from the table; each folder that registers tests calls it at its end (CMake 3.25 sets test
# properties only from the folder that added the test).
function(dtrain_weigh_tests)
  get_property(tests DIRECTORY PROPERTY TESTS)
  foreach(test IN LISTS tests)
    list(FIND DTRAIN_TEST_COSTS ${test} at)
    if(at GREATER_EQUAL 0)
      math(EXPR at "${at} + 1")
      list(GET DTRAIN_TEST_COSTS ${at} seconds)
      set_tests_properties(${test} PROPERTIES COST ${seconds})
    endif()
    get_test_property(${test} LABELS labels)
    if(labels AND "unit" IN_LIST labels)
      continue()
    endif()
    if(test IN_LIST DTRAIN_WAITING_TESTS)
      set_tests_properties(${test} PROPERTIES PROCESSORS 1)
    else()
      set_tests_properties(${test} PROPERTIES PROCESSORS 2)
    endif()
  endforeach()
endfunction()
