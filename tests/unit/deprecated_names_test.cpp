// Names replaced by one name per concept stay usable for one release, as deprecated aliases that
// mean the new ones: PipelineOptions::group and GradScalerOptions::sync_group (process_group), and
// DDPEvent's unscoped kinds (DDPEvent::Kind).
#include <gtest/gtest.h>

#include "dtrain/amp.h"
#include "dtrain/ddp.h"
#include "dtrain/pipeline.h"

// The point of the test is to call them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

TEST(DeprecatedNames, PipelineGroupIsProcessGroup) {
  dtrain::Group world;
  EXPECT_TRUE(dtrain::PipelineOptions().group(world).process_group().is_default());
  EXPECT_TRUE(dtrain::PipelineOptions().process_group(world).group().is_default());
}

TEST(DeprecatedNames, GradScalerSyncGroupIsProcessGroup) {
  EXPECT_FALSE(dtrain::GradScalerOptions().process_group().has_value());
  EXPECT_TRUE(dtrain::GradScalerOptions().sync_group(dtrain::Group()).process_group().has_value());
  EXPECT_TRUE(dtrain::GradScalerOptions().process_group(dtrain::Group()).sync_group().has_value());
}

TEST(DeprecatedNames, UnscopedDDPEventKinds) {
  using K = dtrain::DDPEvent::Kind;
  EXPECT_EQ(dtrain::DDPEvent::kGradReady, K::kGradReady);
  EXPECT_EQ(dtrain::DDPEvent::kBucketLaunched, K::kBucketLaunched);
  EXPECT_EQ(dtrain::DDPEvent::kBucketDone, K::kBucketDone);
  EXPECT_EQ(dtrain::DDPEvent::kBackwardEnd, K::kBackwardEnd);
  EXPECT_EQ(dtrain::DDPEvent::kGradsSynced, K::kGradsSynced);
  const dtrain::DDPEvent e{dtrain::DDPEvent::kBucketDone, 0, 0};
  EXPECT_EQ(e.kind, K::kBucketDone);
}

#pragma GCC diagnostic pop
