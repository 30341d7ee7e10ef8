// How ranks are read from dtrain-run/torchrun, mpirun, srun and explicit values; bad values fail clearly.
#include "comm/launch_env.h"

#include <map>

#include <gtest/gtest.h>

#include "dtrain/errors.h"
#include "test_util.h"
#include "matchers.h"

using dtrain::comm::EnvLookup;
using dtrain::comm::LaunchEnv;
using dtrain::comm::read_launch_env;
using dtrain::test_util::dtrain_error_of;

namespace {

EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end() || it->second.empty()) return std::nullopt;
    return it->second;
  };
}

}  // namespace

TEST(LaunchEnv, TorchrunStyle) {
  LaunchEnv le = read_launch_env(env_of({{"RANK", "3"},
                                         {"WORLD_SIZE", "4"},
                                         {"LOCAL_RANK", "1"},
                                         {"LOCAL_WORLD_SIZE", "2"},
                                         {"DTRAIN_AGENT_STORE", "1"}}));
  EXPECT_EQ(le.rank, 3);
  EXPECT_EQ(le.world_size, 4);
  EXPECT_EQ(le.local_rank, 1);
  EXPECT_EQ(le.local_world_size, 2);
  EXPECT_TRUE(le.dtrain_agent_store);
  EXPECT_EQ(le.launcher, "dtrain-run");
}

TEST(LaunchEnv, RestartCountFromDtrainRunElseTorchrun) {
  // The attempt keys the rendezvous: a restarted group must not meet the failed group's keys.
  const std::map<std::string, std::string> base{{"RANK", "0"}, {"WORLD_SIZE", "1"}};
  auto with = [&](std::map<std::string, std::string> extra) {
    extra.insert(base.begin(), base.end());
    return read_launch_env(env_of(extra)).restart_count;
  };
  EXPECT_EQ(with({}), 0);
  EXPECT_EQ(with({{"TORCHELASTIC_RESTART_COUNT", "2"}}), 2);
  EXPECT_EQ(with({{"DTRAIN_RESTART_COUNT", "1"}, {"TORCHELASTIC_RESTART_COUNT", "1"}}), 1);
  EXPECT_THAT(dtrain_error_of([&] {
                with({{"TORCHELASTIC_RESTART_COUNT", "x"}});
              }),
              HasSubstr("TORCHELASTIC_RESTART_COUNT"));
}

TEST(LaunchEnv, OpenMpi) {
  LaunchEnv le = read_launch_env(env_of({{"OMPI_COMM_WORLD_RANK", "1"},
                                         {"OMPI_COMM_WORLD_SIZE", "2"},
                                         {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  EXPECT_EQ(le.rank, 1);
  EXPECT_EQ(le.world_size, 2);
  EXPECT_EQ(le.local_rank, 1);
  EXPECT_EQ(le.launcher, "mpirun");
}

TEST(LaunchEnv, Slurm) {
  LaunchEnv le = read_launch_env(env_of({{"SLURM_PROCID", "5"},
                                         {"SLURM_NTASKS", "8"},
                                         {"SLURM_LOCALID", "1"},
                                         {"SLURM_NTASKS_PER_NODE", "4"},
                                         {"SLURM_STEP_ID", "0"}}));
  EXPECT_EQ(le.rank, 5);
  EXPECT_EQ(le.world_size, 8);
  EXPECT_EQ(le.local_rank, 1);
  EXPECT_EQ(le.local_world_size, 4);
  EXPECT_EQ(le.launcher, "srun");
}

TEST(LaunchEnv, RankWinsOverSchedulerVariables) {
  LaunchEnv le =
      read_launch_env(env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}));
  EXPECT_EQ(le.rank, 1);
  EXPECT_EQ(le.world_size, 2);
}

TEST(LaunchEnv, ExplicitValuesOverride) {
  LaunchEnv le = read_launch_env(env_of({}), 1, 3);
  EXPECT_EQ(le.rank, 1);
  EXPECT_EQ(le.world_size, 3);
}

TEST(LaunchEnv, BadValuesNameTheVariable) {
  EXPECT_THAT(dtrain_error_of([] { read_launch_env(env_of({})); }), HasSubstr("RANK is not set"));
  EXPECT_THAT(dtrain_error_of([] {
                read_launch_env(env_of({{"RANK", "x1"}, {"WORLD_SIZE", "2"}}));
              }),
              HasSubstr("RANK='x1' is not a non-negative integer"));
  EXPECT_THAT(dtrain_error_of([] {
                read_launch_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "-2"}}));
              }),
              HasSubstr("WORLD_SIZE='-2'"));
  EXPECT_THAT(dtrain_error_of([] {
                read_launch_env(env_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}));
              }),
              HasSubstr("RANK=2 is out of range for WORLD_SIZE=2"));
  EXPECT_THAT(dtrain_error_of([] { read_launch_env(env_of({{"RANK", "0"}})); }), HasSubstr("WORLD_SIZE is not set"));
}

TEST(LaunchEnv, MasterAddressAndPort) {
  auto ep = dtrain::comm::master_from_env(env_of({{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(ep.host, "10.0.0.1");
  EXPECT_EQ(ep.port, 29500);
  EXPECT_THAT(dtrain_error_of([] {
                dtrain::comm::master_from_env(env_of({{"MASTER_PORT", "1"}}));
              }),
              HasSubstr("MASTER_ADDR is not set"));
  EXPECT_THAT(dtrain_error_of([] {
                dtrain::comm::master_from_env(env_of({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}}));
              }),
              HasSubstr("MASTER_PORT='70000' is not a valid port"));
  EXPECT_THAT(dtrain_error_of([] {
                dtrain::comm::master_from_env(env_of({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "http"}}));
              }),
              HasSubstr("MASTER_PORT='http'"));
}

TEST(LaunchEnv, TcpUrls) {
  auto a = dtrain::comm::parse_tcp_url("tcp://127.0.0.1:1234");
  EXPECT_EQ(a.host, "127.0.0.1");
  EXPECT_EQ(a.port, 1234);
  auto b = dtrain::comm::parse_tcp_url("tcp://[::1]:29500");
  EXPECT_EQ(b.host, "::1");
  EXPECT_EQ(b.port, 29500);
  EXPECT_THAT(dtrain_error_of([] { dtrain::comm::parse_tcp_url("tcp://host"); }), HasSubstr("has no port"));
}
