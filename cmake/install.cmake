# `cmake --install` exports dtrain so outside projects can find_package(dtrain) and link dtrain::dtrain
# (or dtrain::dtrain_c, the C API).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# libdtrain_c (the C API, dtrain::dtrain_c) beside it: bindings in other languages load it by name,
# C programs link it and include dtrain_c.h.
install(TARGETS dtrain dtrain_c EXPORT dtrainTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/dtrain DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${PROJECT_SOURCE_DIR}/include/dtrain_c.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT dtrainTargets NAMESPACE dtrain:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dtrain)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/dtrainConfig.cmake.in
  ${CMAKE_BINARY_DIR}/dtrainConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dtrain)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/dtrainConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/dtrainConfig.cmake ${CMAKE_BINARY_DIR}/dtrainConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dtrain)
