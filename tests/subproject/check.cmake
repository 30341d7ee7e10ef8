# cmake -DDTRAIN_SOURCE_DIR=... -DWORK_DIR=... -DTORCH_PREFIX=... -P check.cmake
# Configures tests/subproject (dtrain as a subdirectory) and fails unless the build offers the
# library, the launcher and the consumer's program, and none of dtrain's own tests, examples or
# benchmarks (their defaults are OFF below the top level).
file(REMOVE_RECURSE "${WORK_DIR}")
execute_process(
  COMMAND "${CMAKE_COMMAND}" -S "${DTRAIN_SOURCE_DIR}/tests/subproject" -B "${WORK_DIR}"
          "-DDTRAIN_SOURCE_DIR=${DTRAIN_SOURCE_DIR}" "-DCMAKE_PREFIX_PATH=${TORCH_PREFIX}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "subproject check: configuring a project that adds dtrain as a subdirectory failed:\n${out}\n${err}")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${WORK_DIR}" --target help
                RESULT_VARIABLE rc OUTPUT_VARIABLE targets)
foreach(wanted dtrain dtrain-run app)
  if(NOT targets MATCHES "\\.\\.\\. ${wanted}\n")
    message(FATAL_ERROR "subproject check: target '${wanted}' missing from the subproject build")
  endif()
endforeach()
foreach(unwanted ddp_test train_fashion_mnist bench_ddp hello_distributed)
  if(targets MATCHES "\\.\\.\\. ${unwanted}\n")
    message(FATAL_ERROR "subproject check: dtrain's '${unwanted}' is built inside another project: "
                        "tests, examples and benchmarks must default to OFF there")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK_DIR}")
message(STATUS "subproject check: dtrain, dtrain-run and app only")
