# The tests, examples and benchmarks share one precompiled header of the LibTorch headers they all
# include: a test file spent about half of its compile time parsing them (ddp_test.cpp: 115 s plain,
# 65 s with it). The library has a header of its own (src/CMakeLists.txt): its flags (-fPIC,
# dtrain_EXPORTS) differ, and GCC uses a .gch only under the flags it was made with.
#
# dtrain_consumer_pch(<directory>) gives every executable of <directory> that links dtrain::dtrain
# the shared header (REUSE_FROM: it is compiled once). Only third-party headers go in it: a dtrain
# header there would recompile every consumer whenever it changed, and hide a missing include.
# The owner is an executable, so its .gch is made with -fPIE as the consumers are compiled.
#
# Every tree that builds consumers uses it: the second LibTorch tree and the sanitizer trees too,
# where each test program costs as much to parse as in the first.
if(NOT (DTRAIN_BUILD_EXAMPLES OR DTRAIN_BUILD_BENCH OR DTRAIN_BUILD_TESTS))
  function(dtrain_consumer_pch dir)
  endfunction()
  return()
endif()
add_executable(dtrain_consumer_pch ${CMAKE_CURRENT_LIST_DIR}/consumer_pch_main.cpp)
target_link_libraries(dtrain_consumer_pch PRIVATE dtrain::dtrain)
target_compile_options(dtrain_consumer_pch PRIVATE ${DTRAIN_CONSUMER_OPTIMIZE})  # as its consumers
target_precompile_headers(dtrain_consumer_pch PRIVATE
  <ATen/ATen.h>
  <torch/nn/module.h>
  <torch/nn/modules/linear.h>
  <torch/nn/functional/loss.h>
  <torch/optim/adam.h>
  <torch/optim/sgd.h>
  <torch/csrc/distributed/c10d/ProcessGroup.hpp>
  <torch/csrc/distributed/c10d/Store.hpp>)

function(dtrain_consumer_pch dir)
  get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  foreach(target IN LISTS targets)
    get_target_property(type ${target} TYPE)
    get_target_property(libs ${target} LINK_LIBRARIES)
    if(type STREQUAL "EXECUTABLE" AND NOT target STREQUAL "dtrain_consumer_pch" AND "dtrain::dtrain" IN_LIST libs)
      target_precompile_headers(${target} REUSE_FROM dtrain_consumer_pch)
    endif()
  endforeach()
endfunction()
