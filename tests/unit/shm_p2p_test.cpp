// Point-to-point over shared memory (src/comm/shm/p2p.h) between forked ranks: order, tags, any
// source, messages larger than the ring, both ranks sending first, and every failure a user can
// cause (mismatched dtype or shape, a dead peer, a missing sender), each ending in seconds.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "comm/shm/p2p.h"
#include "dtrain/errors.h"
#include "shm_fork.h"
#include "matchers.h"
#include "time_scale.h"

using namespace dtrain::shm;
using shm_fork::expect_ok;
using shm_fork::run_ranks_shared;

namespace {

using Body = std::function<void(P2p&, int)>;

std::vector<std::string> run_p2p(int n, const Body& body,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  return run_ranks_shared(
      n,
      [&](std::shared_ptr<Comm> c, int r) {
        P2p p2p(c, [](const MsgDesc& d) {
          return "dtype " + std::to_string(d.dtype) + " of " + std::to_string(d.bytes) + " bytes";
        });
        body(p2p, r);
      },
      timeout);
}

MsgDesc desc_of(size_t bytes, int64_t tag, int32_t dtype = 1) {
  MsgDesc d;
  d.tag = tag;
  d.dtype = dtype;
  d.ndim = 1;
  d.sizes[0] = static_cast<int64_t>(bytes);
  d.bytes = bytes;
  return d;
}

std::vector<uint8_t> pattern(size_t bytes, int seed) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<uint8_t>((i * 131 + seed * 17 + i / 251) & 0xff);
  return v;
}

void send_blocking(P2p& p, int dst, const std::vector<uint8_t>& v, int64_t tag) {
  auto op = p.send(dst, v.data(), desc_of(v.size(), tag));
  p.wait(*op);
}

void expect_received(P2p& p, int src, size_t bytes, int seed, int64_t tag) {
  std::vector<uint8_t> got(bytes, 0xAB);
  auto op = p.recv(src, got.data(), desc_of(bytes, tag));
  p.wait(*op);
  if (got != pattern(bytes, seed)) throw std::runtime_error("wrong bytes in a message of " + std::to_string(bytes));
}

// The test segment's rings are 4 KiB (shm_fork::kSlot): these sizes cover empty messages, one
// byte, exact fits, and messages that wrap the ring many times.
const std::vector<size_t> kSizes = {0, 1, 3, 255, 256, 3840, 4096, 4097, 12345, 1 << 20};

}  // namespace

TEST(ShmP2p, MessagesOfEverySizeArriveIntactAndInOrder) {
  expect_ok(run_p2p(2, [](P2p& p, int r) {
    for (size_t i = 0; i < kSizes.size(); ++i) {
      if (r == 0)
        send_blocking(p, 1, pattern(kSizes[i], static_cast<int>(i)), 7);
      else
        expect_received(p, 0, kSizes[i], static_cast<int>(i), 7);
    }
  }));
}

TEST(ShmP2p, ManyAsynchronousSendsCompleteWhateverOrderTheyAreWaitedIn) {
  expect_ok(run_p2p(2, [](P2p& p, int r) {
    constexpr int kCount = 40;
    std::vector<std::vector<uint8_t>> bufs;
    std::vector<std::shared_ptr<P2p::Op>> ops;
    for (int i = 0; i < kCount; ++i) {
      const size_t bytes = 100 + 997 * static_cast<size_t>(i);
      bufs.push_back(r == 0 ? pattern(bytes, i) : std::vector<uint8_t>(bytes));
      ops.push_back(r == 0 ? p.send(1, bufs.back().data(), desc_of(bytes, 0))
                           : p.recv(0, bufs.back().data(), desc_of(bytes, 0)));
    }
    for (int i = kCount - 1; i >= 0; --i) p.wait(*ops[i]);
    if (r == 1)
      for (int i = 0; i < kCount; ++i)
        if (bufs[i] != pattern(bufs[i].size(), i)) throw std::runtime_error("message " + std::to_string(i));
  }));
}

// Note [Send pusher]: a send larger than the ring completes while its sender runs no point-to-point
// code at all (here it only polls a flag in memory shared with the receiver), as a pipeline stage
// computes after posting its boundary send. Without the pusher the rest of the message would wait
// for the sender's next call, and the sender would give up after 5 s.
TEST(ShmP2p, ASendLargerThanTheRingCompletesWhileItsSenderComputes) {
  void* mem = mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* received = new (mem) std::atomic<int>(0);
  const size_t bytes = 64 * 4096 + 123;  // many rings' worth
  expect_ok(run_p2p(2, [&](P2p& p, int r) {
    if (r == 0) {
      const auto v = pattern(bytes, 5);
      auto op = p.send(1, v.data(), desc_of(bytes, 9));
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (received->load() == 0) {
        if (std::chrono::steady_clock::now() > until)
          throw std::runtime_error("the receive did not complete while its sender ran no point-to-point code");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      p.wait(*op);
    } else {
      expect_received(p, 0, bytes, 5, 9);
      received->store(1);
    }
  }));
  munmap(mem, sizeof(std::atomic<int>));
}

TEST(ShmP2p, ReceivesMatchByTagNotByArrival) {
  expect_ok(run_p2p(2, [](P2p& p, int r) {
    if (r == 0) {
      std::vector<uint8_t> b1 = pattern(5000, 1), b2 = pattern(300, 2);
      auto s1 = p.send(1, b1.data(), desc_of(5000, 1));
      auto s2 = p.send(1, b2.data(), desc_of(300, 2));
      p.wait(*s2);
      p.wait(*s1);
    } else {
      expect_received(p, 0, 300, 2, 2);  // tag 2 first, though it was sent after the tag-1 message
      expect_received(p, 0, 5000, 1, 1);
    }
  }));
}

TEST(ShmP2p, BothRanksSendingFirstDoNotDeadlock) {
  // Each message is 64 rings long: a send can complete only while the peer takes it, and the peer
  // is itself blocked in a send. The waiting rank stashes what arrives.
  expect_ok(run_p2p(2, [](P2p& p, int r) {
    send_blocking(p, 1 - r, pattern(1 << 18, r), 0);
    expect_received(p, 1 - r, 1 << 18, 1 - r, 0);
  }));
}

TEST(ShmP2p, AnySourceReportsEachSender) {
  expect_ok(run_p2p(4, [](P2p& p, int r) {
    if (r != 0) {
      send_blocking(p, 0, pattern(1000, r), 5);
      return;
    }
    std::set<int> from;
    for (int i = 0; i < 3; ++i) {
      std::vector<uint8_t> got(1000);
      auto op = p.recv(-1, got.data(), desc_of(1000, 5));
      p.wait(*op);
      const int src = P2p::source(*op);
      if (got != pattern(1000, src)) throw std::runtime_error("the message from " + std::to_string(src));
      from.insert(src);
    }
    if (from != std::set<int>{1, 2, 3}) throw std::runtime_error("not one message from each sender");
  }));
}

TEST(ShmP2p, AMismatchedShapeFailsBothRanksWithTheSameLine) {
  auto errors = run_p2p(2, [](P2p& p, int r) {
    std::vector<uint8_t> buf(5000);
    if (r == 0) {
      auto op = p.send(1, buf.data(), desc_of(4000, 3));
      p.wait(*op);
    } else {
      auto op = p.recv(0, buf.data(), desc_of(5000, 3));
      p.wait(*op);
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(errors[r], HasSubstr("rank 1: recv from rank 0 (tag 3) expected dtype 1 of 5000 bytes but rank 0 sent "
                                     "dtype 1 of 4000 bytes"))
        << "rank " << r << ": " << errors[r];
  }
}

TEST(ShmP2p, AMismatchedDtypeFailsTheReceiveAndLaterSendsToIt) {
  auto errors = run_p2p(2, [](P2p& p, int r) {
    std::vector<uint8_t> buf(64);
    if (r == 0) {
      auto op = p.send(1, buf.data(), desc_of(64, 0, /*dtype=*/6));
      p.wait(*op);
    } else {
      auto op = p.recv(0, buf.data(), desc_of(64, 0, /*dtype=*/7));
      p.wait(*op);
    }
  });
  EXPECT_THAT(errors[1], HasSubstr("expected dtype 7 of 64 bytes but rank 0 sent dtype 6 of 64 bytes")) << errors[1];
  EXPECT_EQ(errors[0], errors[1]);
}

TEST(ShmP2p, ADeadSenderIsNoticedWithoutWaitingForTheTimeout) {
  const auto start = std::chrono::steady_clock::now();
  auto errors = run_p2p(
      2,
      [](P2p& p, int r) {
        if (r == 0) _exit(0);  // dies without sending
        std::vector<uint8_t> buf(16);
        auto op = p.recv(0, buf.data(), desc_of(16, 0));
        p.wait(*op);
      },
      std::chrono::seconds(60));
  EXPECT_THAT(errors[1], HasSubstr("rank 1: recv from rank 0 (tag 0) over shared memory: rank 0 (pid ")) << errors[1];
  EXPECT_THAT(errors[1], HasSubstr("exited before completing it")) << errors[1];
  EXPECT_LT(std::chrono::steady_clock::now() - start, dtrain::test_util::scaled(std::chrono::seconds(5)));
}

TEST(ShmP2p, AMissingMessageTimesOutNamingTheTag) {
  // The tag-1 message is taken into the receiver's stash (so its send completes); the receive for
  // tag 2 finds nothing and times out.
  shm_fork::SharedFlag timed_out;
  auto errors = run_p2p(
      2,
      [&](P2p& p, int r) {
        std::vector<uint8_t> buf(16);
        auto op = r == 0 ? p.send(1, buf.data(), desc_of(16, 1)) : p.recv(0, buf.data(), desc_of(16, 2));
        timed_out.set_on_throw([&] { p.wait(*op); });
        if (r == 0) timed_out.wait();  // alive until the receiver gives up: a timeout, not a dead peer
      },
      std::chrono::milliseconds(300));
  EXPECT_EQ(errors[0], "");
  EXPECT_THAT(errors[1], HasSubstr("rank 1: recv from rank 0 (tag 2) over shared memory timed out after 300 ms"))
      << errors[1];
}

TEST(ShmP2p, ASendNobodyReceivesTimesOut) {
  shm_fork::SharedFlag timed_out;
  auto errors = run_p2p(
      2,
      [&](P2p& p, int r) {
        std::vector<uint8_t> buf(16);
        if (r == 1) {
          timed_out.wait();  // alive, but never receives, until the sender has given up
          return;
        }
        auto op = p.send(1, buf.data(), desc_of(16, 1));
        timed_out.set_on_throw([&] { p.wait(*op); });
      },
      std::chrono::milliseconds(300));
  EXPECT_THAT(errors[0],
              HasSubstr("rank 0: send to rank 1 (tag 1) over shared memory timed out after 300 ms: the receiver "
                        "did not take the message"))
      << errors[0];
}

// What another program could write into the job's segment: a head past the ring, a tail past the
// head, a length no allocation holds. Each is an error naming the peer and the segment, never a
// read or write outside the ring. Rank 0 plays the hostile sender (or rank 1 the hostile receiver)
// by writing the channel's shared state directly.
namespace {

// A message header as p2p.cpp's WireHeader lays it out (magic "dp2phdr1", sequence number 1).
struct PlantedHeader {
  uint64_t magic = 0x6470327068647231ULL;
  uint64_t seq = 1;
  MsgDesc desc;
};

void plant_message(const Segment& seg, const MsgDesc& d, uint64_t head) {
  PlantedHeader h;
  h.desc = d;
  std::memcpy(seg.ring(0, 1), &h, sizeof h);
  seg.chan(0, 1).head.store(head, std::memory_order_release);
}

// Rank 1 receives `bytes` with `tag` once rank 0 has planted; rank 0 stays alive until rank 1 is done.
std::vector<std::string> receive_planted(size_t bytes, int64_t tag, const std::function<void(const Segment&)>& plant) {
  shm_fork::SharedFlag planted, done;
  return run_ranks_shared(2, [&](std::shared_ptr<Comm> c, int r) {
    if (r == 0) {
      plant(c->segment());
      planted.set();
      done.wait();
      return;
    }
    P2p p(c, [](const MsgDesc& d) { return std::to_string(d.bytes) + " bytes"; });
    planted.wait();
    std::vector<uint8_t> buf(bytes);
    done.set_on_throw([&] {
      auto op = p.recv(0, buf.data(), desc_of(bytes, tag));
      p.wait(*op);
    });
    done.set();
  });
}

}  // namespace

TEST(ShmP2p, AHeadPastTheRingIsAnErrorNotAReadPastIt) {
  const auto errors = receive_planted(2 * shm_fork::kSlot, 4, [](const Segment& seg) {
    plant_message(seg, desc_of(2 * shm_fork::kSlot, 4), 3 * seg.chan_bytes() + 100);
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_THAT(errors[1], HasSubstr("rank 1: the point-to-point channel from rank 0 of shared-memory segment /dtrain-"))
      << errors[1];
  EXPECT_THAT(errors[1], HasSubstr("is corrupt (the sender's head ")) << errors[1];
}

TEST(ShmP2p, ALengthNoAllocationHoldsIsAnError) {
  MsgDesc huge = desc_of(16, 6);
  huge.bytes = ~uint64_t{0} - 5;
  const auto errors = receive_planted(16, 5, [&](const Segment& seg) { plant_message(seg, huge, 256); });
  EXPECT_THAT(errors[1], HasSubstr("is corrupt (message 1 claims " + std::to_string(huge.bytes) + " bytes)"))
      << errors[1];
}

TEST(ShmP2p, ATailPastTheHeadIsAnErrorNotRoomFromNothing) {
  shm_fork::SharedFlag planted, done;
  const auto errors = run_ranks_shared(2, [&](std::shared_ptr<Comm> c, int r) {
    if (r == 1) {  // the hostile receiver
      c->segment().chan(0, 1).tail.store(12345, std::memory_order_release);
      planted.set();
      done.wait();
      return;
    }
    P2p p(c, [](const MsgDesc& d) { return std::to_string(d.bytes) + " bytes"; });
    planted.wait();
    const auto v = pattern(64, 1);
    done.set_on_throw([&] { send_blocking(p, 1, v, 0); });
    done.set();
  });
  EXPECT_THAT(errors[0], HasSubstr("rank 0: the point-to-point channel to rank 1 of shared-memory segment /dtrain-"))
      << errors[0];
  EXPECT_THAT(errors[0], HasSubstr("is corrupt (the receiver's tail 12345 is not within ")) << errors[0];
  EXPECT_EQ(errors[1], "");
}
