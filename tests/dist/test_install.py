"""`cmake --install` gives outside projects a working dtrain: install the build tree into a temporary
prefix, configure and build tests/install/ (find_package(dtrain), dtrain::dtrain) against it, and run
it on 2 ranks with the launcher the package names in dtrain_LAUNCHER (the installed dtrain-run); the
same for its C program over the installed libdtrain_c and dtrain_c.h."""
import os
import shutil
import subprocess
import tempfile
import unittest

from harness import ROOT, DistTestCase, clean_env

CONSUMER_SRC = os.path.join(ROOT, "tests", "install")


class Install(DistTestCase):
    def run_step(self, argv, timeout, env=None):
        res = self.run_one(argv, env or clean_env(), timeout=timeout)
        self.assertEqual(res.rc, 0, f"step failed:\n{res}")
        return res

    def test_find_package_build_and_run(self):
        build = os.environ.get("DTRAIN_BUILD_DIR")
        if not build or not os.path.exists(os.path.join(build, "cmake_install.cmake")):
            self.skipTest("DTRAIN_BUILD_DIR (a configured dtrain build tree) is not set")
        cmake = shutil.which("cmake")
        self.assertTrue(cmake, "cmake is not on PATH")
        tmp = tempfile.mkdtemp(prefix="dtrain-install-")
        self.addCleanup(shutil.rmtree, tmp, True)
        prefix, consumer = os.path.join(tmp, "prefix"), os.path.join(tmp, "consumer")

        self.run_step([cmake, "--install", build, "--prefix", prefix], 120)
        for rel in ("include/dtrain/dtrain.h", "include/dtrain/process_group.h", "include/dtrain_c.h"):
            self.assertTrue(os.path.exists(os.path.join(prefix, rel)), f"{rel} was not installed")
        configs = [os.path.join(d, "dtrainConfig.cmake") for d in
                   (os.path.join(prefix, "lib", "cmake", "dtrain"),
                    os.path.join(prefix, "lib", "x86_64-linux-gnu", "cmake", "dtrain"))]
        self.assertTrue(any(map(os.path.exists, configs)), f"no dtrainConfig.cmake under {prefix}")

        # A fresh configure that can only find dtrain through the prefix (no build tree in the path).
        configure = self.run_step([cmake, "-S", CONSUMER_SRC, "-B", consumer, f"-DCMAKE_PREFIX_PATH={prefix}",
                                   "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON"], 120)
        # dtrain_LAUNCHER must name the installed launcher, not a path under a dependency's prefix
        # (the package configs find_dependency(Torch) loads reset PACKAGE_PREFIX_DIR to theirs).
        named = [l.split("=", 1)[1] for l in configure.out.splitlines() if l.startswith("-- dtrain_LAUNCHER=")]
        self.assertEqual(len(named), 1, f"the consumer did not print dtrain_LAUNCHER:\n{configure}")
        launcher = named[0]
        self.assertEqual(os.path.realpath(launcher), os.path.realpath(os.path.join(prefix, "bin", "dtrain-run")))
        self.assertTrue(os.path.isfile(launcher) and os.access(launcher, os.X_OK),
                        f"dtrain_LAUNCHER={launcher} is not an executable file")
        with open(os.path.join(consumer, "CMakeCache.txt")) as f:
            cache = f.read()
        self.assertIn(f"dtrain_DIR:PATH={prefix}", cache, "dtrain was not found in the install prefix")
        self.run_step([cmake, "--build", consumer, "-j2"], 240)
        # Each runs against the installed library, not the build tree's. consumer_c is the C API from C:
        # the installed libdtrain_c (dtrain::dtrain_c), which finds libdtrain and LibTorch by its RUNPATH.
        self.run_installed(os.path.join(consumer, "consumer"), "libdtrain.so", prefix, launcher,
                           "consumer OK: rank {r} of 2, sum 3")
        self.run_installed(os.path.join(consumer, "consumer_c"), "libdtrain_c.so", prefix, launcher,
                           "consumer_c OK: rank {r} of 2")

    def run_installed(self, program, library, prefix, launcher, ok_line):
        ldd = subprocess.run(["ldd", program], capture_output=True, text=True, timeout=30).stdout
        lib_line = [l for l in ldd.splitlines() if library in l]
        self.assertTrue(lib_line and prefix in lib_line[0], f"{library} is not the installed one:\n{ldd}")
        res = self.run_step([launcher, "--standalone", "--nproc_per_node", 2, "--grace_period", 2, program], 90,
                            clean_env(DTRAIN_TIMEOUT_S=60))
        for r in range(2):
            self.assertIn(f"[rank {r}] " + ok_line.format(r=r), res.out, str(res))

if __name__ == "__main__":
    unittest.main()
