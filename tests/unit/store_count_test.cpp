// comm::wait_for_count (src/comm/store_count.h): the store counter behind new_group's barrier,
// destroy_process_group's checkout and the rendezvous' verdict receipts.
#include <gtest/gtest.h>

#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/store_count.h"
#include "test_util.h"

using dtrain::comm::wait_for_count;
using dtrain::test_util::error_of;

TEST(StoreCount, ReturnsOnceEveryMemberCountedIn) {
  c10d::HashStore store;
  store.add("k", 1);
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    store.add("k", 1);
  });
  EXPECT_EQ(error_of([&] { wait_for_count(store, "k", 2, std::chrono::seconds(30), "ctx", "fix"); }), "");
  late.join();
  EXPECT_EQ(store.add("k", 0), 2);
}

TEST(StoreCount, TimeoutNamesTheCountTheKeyAndTheRemedy) {
  c10d::HashStore store;
  store.add("pg/x/connected", 1);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of([&] {
    wait_for_count(store, "pg/x/connected", 3, std::chrono::milliseconds(100), "rank 1: new_group", "fix it");
  });
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(100));
  EXPECT_EQ(e,
            "rank 1: new_group: only 1 of 3 members reached store key 'pg/x/connected' within 100 ms (2 missing): "
            "fix it");
}
