// Forked ranks on one shared-memory segment, for the torch-free tests of src/comm/shm: each rank
// runs a function and reports its error (or "") through a pipe.
#pragma once

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/shm/comm.h"

namespace shm_fork {

using dtrain::shm::Comm;
using dtrain::shm::Segment;
using Fn = std::function<void(Comm&, int)>;
using SharedFn = std::function<void(std::shared_ptr<Comm>, int)>;

constexpr size_t kSlot = 4096;  // small slots so that modest sizes take several chunks

// Runs fn on n forked ranks; returns each rank's error message ("" = success).
inline std::vector<std::string> run_ranks_shared(int n, const SharedFn& fn,
                                                 std::chrono::milliseconds timeout = std::chrono::seconds(10),
                                                 size_t slot = kSlot) {
  Segment seg = Segment::create(Segment::unique_name("test"), n, slot);
  std::vector<int> labels;
  for (int r = 0; r < n; ++r) labels.push_back(r);
  std::vector<pid_t> pids;
  std::vector<int> fds;
  for (int r = 0; r < n; ++r) {
    int p[2];
    EXPECT_EQ(pipe(p), 0);
    pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      std::string err;
      try {
        fn(std::make_shared<Comm>(Segment::attach(seg.name(), n, slot), r, labels, timeout), r);
      } catch (const std::exception& e) {
        err = e.what();
        if (err.empty()) err = "(empty error)";
      }
      (void)!write(p[1], err.data(), err.size());
      _exit(0);
    }
    close(p[1]);
    pids.push_back(pid);
    fds.push_back(p[0]);
  }
  std::vector<std::string> errors(n);
  for (int r = 0; r < n; ++r) {
    char buf[1024];
    ssize_t k;
    while ((k = read(fds[r], buf, sizeof(buf))) > 0) errors[r].append(buf, k);
    close(fds[r]);
    int status = 0;
    waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) && errors[r].empty()) errors[r] = "rank died";
  }
  return errors;
}

inline std::vector<std::string> run_ranks(int n, const Fn& fn,
                                          std::chrono::milliseconds timeout = std::chrono::seconds(10),
                                          size_t slot = kSlot) {
  return run_ranks_shared(
      n, [&](std::shared_ptr<Comm> c, int r) { fn(*c, r); }, timeout, slot);
}

// A flag in memory the forked ranks share (mapped before they fork). A rank that must stay alive
// until a peer has failed (a timeout, not a dead peer) waits for the peer to set it, rather than
// sleeping a fixed time that a loaded machine or a sanitizer can outlast.
class SharedFlag {
 public:
  SharedFlag()
      : p_(static_cast<std::atomic<int>*>(
            mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0))) {
    if (p_ == MAP_FAILED) throw std::runtime_error("SharedFlag: mmap failed");
    new (p_) std::atomic<int>(0);
  }
  ~SharedFlag() { munmap(p_, sizeof(std::atomic<int>)); }
  SharedFlag(const SharedFlag&) = delete;
  SharedFlag& operator=(const SharedFlag&) = delete;

  void set() { p_->store(1); }
  // Until set, or `cap` (then the test fails on its own expectations instead of hanging).
  void wait(std::chrono::milliseconds cap = std::chrono::seconds(60)) const {
    const auto deadline = std::chrono::steady_clock::now() + cap;
    while (!p_->load() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Runs f(); sets the flag when it throws, and rethrows.
  template <class F>
  void set_on_throw(F&& f) {
    try {
      f();
    } catch (...) {
      set();
      throw;
    }
  }

 private:
  std::atomic<int>* p_;
};

inline void expect_ok(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

}  // namespace shm_fork
