// Waiting primitives shared by the shared-memory collectives (comm.cpp) and point-to-point
// (p2p.cpp): futex sleep and wake on a 32-bit word of the segment, the spin/yield/sleep schedule,
// and whether a peer process has exited. Torch-free.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DTRAIN_CPU_RELAX() _mm_pause()
#else
#define DTRAIN_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace dtrain::shm {

using Clock = std::chrono::steady_clock;

// Spin for this long, then yield for this long, then sleep on the futex.
constexpr auto kSpin = std::chrono::microseconds(30);
constexpr auto kYield = std::chrono::microseconds(300);
constexpr long kSleepNs = 10'000'000;  // futex timeout: how often a sleeper wakes to check for failures
// How often a waiter checks the abort flag, the timeout and whether the awaited process exited: at
// every wake-up of a sleeper, so a dead peer is noticed within about 10 ms (docs/features.md promises 50;
// ShmComm.ADeadRankIsNoticedWithin50Milliseconds measures it). A check costs a kill() and a read of
// /proc/<pid>/stat, nothing beside a 10 ms sleep. It was 50 ms, which put the worst case above 50.
constexpr auto kCheckPeriod = std::chrono::nanoseconds(kSleepNs);

// Sleeps while *addr == expected, at most timeout_ns (spurious wake-ups are allowed).
void futex_wait(std::atomic<uint32_t>* addr, uint32_t expected, long timeout_ns);
void futex_wake(std::atomic<uint32_t>* addr);

// The identity of this process's pid namespace (0 if unknown): pids compare only within one.
uint64_t pid_namespace();
// Whether a process of this pid namespace has exited (gone, or a zombie not yet reaped).
bool exited(int32_t pid);

}  // namespace dtrain::shm
