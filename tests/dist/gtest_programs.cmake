# The multi-rank GoogleTest programs whose file ends in DTRAIN_DIST_TEST_MAIN() (every rank runs every
# case): dtrain_gtest_program(<name>) declares tests/dist/<name>.cpp; CI's trees compile them in the
# groups below (cmake/gtest_groups.cmake). The groups follow what the sanitizer trees build
# (scripts/sanitize.sh), which compile a whole group for any one of its programs: ThreadSanitizer's
# three, AddressSanitizer's, and the rest.
set(DTRAIN_DIST_GTEST_GROUPS
  "dist_group_threads:ddp_test,ddp_overlap_test,pipeline_test"
  "dist_group_collectives:collectives_test,collectives_random_test,comm_hooks_test,monitor_dist_test,amp_dist_test,sampler_dist_test,sync_batchnorm_test"
  "dist_group_parallel:zero_test,join_test,activation_checkpoint_dist_test,tensor_parallel_test,tp_checkpoint_test,tp_pipeline_test,expert_parallel_test"
  "dist_group_other:tensor_collectives_test,broken_group_test,ddp_options_test,zero_partition_test,join_hooks_test,powersgd_golden_test,group_ids_test,device_mesh_test")

# What every such program is given, alone or in a group: some read dtrain's internals (src/: the
# group's collective count, compat's optimizer state keys) and goldens in JSON.
function(dtrain_dist_gtest_settings target)
  target_link_libraries(${target} PRIVATE dtrain::dtrain dtrain_util GTest::gtest GTest::gmock
                                          nlohmann_json::nlohmann_json)
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/tests/common ${PROJECT_SOURCE_DIR}/examples
                                               ${PROJECT_SOURCE_DIR}/src)
  target_compile_definitions(${target} PRIVATE
    DTRAIN_ZERO_PARTITION_GOLDEN="${PROJECT_SOURCE_DIR}/tests/data/zero_partition_golden.json"
    DTRAIN_POWERSGD_GOLDEN="${PROJECT_SOURCE_DIR}/tests/data/powersgd_golden.json")
endfunction()

function(dtrain_gtest_program name)
  dtrain_gtest_executable(grouped ${name} dtrain_dist_gtest_settings ${name}.cpp)
endfunction()

# After every dtrain_gtest_program. In a group the files' own mains are gone and the group's adds
# their environment (dist_main.h).
function(dtrain_dist_gtest_groups)
  dtrain_gtest_groups(dtrain_dist_gtest_settings
    "#include \"dist_main.h\"\n#undef DTRAIN_DIST_TEST_MAIN\n#define DTRAIN_DIST_TEST_MAIN()\n#define DTRAIN_GTEST_GROUP_ENVIRONMENT new DistEnvironment()"
    ${DTRAIN_DIST_GTEST_GROUPS})
endfunction()
