// Slurm's host lists and task counts, the port derived from a job id, the rendezvous derived from a
// job's variables (MASTER_ADDR / MASTER_PORT win), and an srun step as its tasks see it.
#include "common/slurm.h"
#include "matchers.h"

#include <map>

#include <gtest/gtest.h>

#include "comm/launch_env.h"
#include "test_util.h"

using dtrain::test_util::dtrain_error_of;
namespace slurm = dtrain::slurm;
using Strings = std::vector<std::string>;

namespace {

dtrain::env::Lookup env_of(std::map<std::string, std::string> vars) {
  return [vars](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end() || it->second.empty()) return std::nullopt;
    return it->second;
  };
}

Strings hosts(const std::string& list) { return slurm::expand_hosts(list, "LIST", "REMEDY"); }
std::string host_error(const std::string& list) {
  return dtrain_error_of([&] { hosts(list); });
}

// An srun step of 4 tasks, 2 per node, seen by task 3 (the second on node 1).
std::map<std::string, std::string> step_vars() {
  return {{"SLURM_STEP_NUM_TASKS", "4"},
          {"SLURM_PROCID", "3"},
          {"SLURM_LOCALID", "1"},
          {"SLURM_NODEID", "1"},
          {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"},
          {"SLURM_JOB_ID", "123456"},
          {"SLURM_STEP_NODELIST", "n[07-08]"}};
}

}  // namespace

TEST(SlurmHostList, ExpandsRangesKeepingTheirWidth) {
  EXPECT_EQ(hosts("node01"), Strings({"node01"}));
  EXPECT_EQ(hosts("node[01-03],other"), Strings({"node01", "node02", "node03", "other"}));
  EXPECT_EQ(hosts("n[08-10,7]"), Strings({"n08", "n09", "n10", "n7"}));
  EXPECT_EQ(hosts("gpu[1-2]-ib,cpu[9]"), Strings({"gpu1-ib", "gpu2-ib", "cpu9"}));
  // The last bracket varies fastest, as Slurm prints such names.
  EXPECT_EQ(hosts("r[1-2]n[1-2]"), Strings({"r1n1", "r1n2", "r2n1", "r2n2"}));
  EXPECT_EQ(hosts("a.b.example,c"), Strings({"a.b.example", "c"}));
}

TEST(SlurmHostList, MalformedListsNameTheVariableAndTheRemedy) {
  for (const char* bad : {"n[1-3", "n1-3]", "n[[1]]", "n[3-1]", "n[a-b]", "n[1-]", "n[]", "a,,b", "n[1]x]"}) {
    const std::string e = host_error(bad);
    EXPECT_EQ(e.rfind(std::string("LIST='") + bad + "' is not a Slurm host list (", 0), 0u) << e;
    EXPECT_THAT(e, HasSubstr("): REMEDY")) << e;
  }
  EXPECT_THAT(host_error("n[1-3"), HasSubstr("not closed"));
  EXPECT_THAT(host_error("n[3-1]"), HasSubstr("runs backwards"));
  EXPECT_THAT(host_error("n[1-99999999]"), HasSubstr("too long"));
  // Few hosts of long names, or many of short ones, but not 2^20 hosts of 48 letters (55 MiB).
  EXPECT_EQ(hosts(std::string(4000, 'n') + "[1-2]").size(), 2u);
  EXPECT_THAT(host_error(std::string(48, 'n') + "[0-1048575]"), HasSubstr("over 16 MiB of names"));
  EXPECT_THAT(host_error("n[0-1023]" + std::string(48, 'x') + "[0-1023]"), HasSubstr("over 16 MiB of names"));
}

TEST(SlurmTaskCounts, ExpandsRepeats) {
  EXPECT_EQ(slurm::expand_counts("2", "V", ""), std::vector<int>({2}));
  EXPECT_EQ(slurm::expand_counts("2(x3),1", "V", ""), std::vector<int>({2, 2, 2, 1}));
  for (const char* bad : {"x", "2(3)", "2(x3", "-1", "2(x)"})
    EXPECT_THAT(dtrain_error_of([&] { slurm::expand_counts(bad, "V", "R"); }),
                HasSubstr(std::string("V='") + bad + "' is not Slurm's task counts"))
        << bad;
}

TEST(SlurmPort, FifteenThousandPlusTheLastFourDigits) {
  EXPECT_EQ(slurm::port_from_job_id(7), 15007);
  EXPECT_EQ(slurm::port_from_job_id(123456), 18456);
  EXPECT_EQ(slurm::port_from_job_id(9999), 24999);
  EXPECT_EQ(slurm::port_from_job_id(10000), 15000);
}

TEST(SlurmMaster, DerivedFromTheStepAndSaidSo) {
  auto m = slurm::master(env_of(step_vars()), "R");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->host, "n07");
  EXPECT_EQ(m->port, 18456);
  EXPECT_THAT(m->note, HasSubstr("MASTER_ADDR=n07 (the first host of SLURM_STEP_NODELIST=n[07-08])")) << m->note;
  EXPECT_THAT(m->note, HasSubstr("MASTER_PORT=18456 (15000 + the last 4 digits of SLURM_JOB_ID=123456")) << m->note;
}

TEST(SlurmMaster, ExplicitValuesWin) {
  auto vars = step_vars();
  vars["MASTER_PORT"] = "29501";
  auto m = slurm::master(env_of(vars), "R");
  EXPECT_EQ(m->host, "n07");
  EXPECT_EQ(m->port, 29501);
  EXPECT_THAT(m->note, Not(HasSubstr("MASTER_PORT="))) << m->note;
  vars["MASTER_ADDR"] = "10.1.2.3";
  m = slurm::master(env_of(vars), "R");
  EXPECT_EQ(m->host, "10.1.2.3");
  EXPECT_EQ(m->note, "");
}

TEST(SlurmMaster, JobNodeListWhenNoStepAndNothingOutsideAJob) {
  auto m = slurm::master(env_of({{"SLURM_JOB_ID", "5"}, {"SLURM_JOB_NODELIST", "a[3-4]"}}), "R");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->host, "a3");
  EXPECT_EQ(m->port, 15005);
  EXPECT_FALSE(slurm::master(env_of({{"SLURM_JOB_NODELIST", "a"}}), "R"));
  EXPECT_FALSE(slurm::master(env_of({{"SLURM_JOB_ID", "5"}}), "R"));
  EXPECT_THAT(dtrain_error_of([] {
                slurm::master(env_of({{"SLURM_JOB_ID", "5"}, {"SLURM_STEP_NODELIST", "a[1-"}}), "set MASTER_ADDR");
              }),
              HasSubstr("SLURM_STEP_NODELIST='a[1-' is not a Slurm host list"));
}

TEST(SlurmStep, TheTaskItsHostAndItsNeighbours) {
  auto s = slurm::step(env_of(step_vars()), "R");
  ASSERT_TRUE(s);
  EXPECT_EQ(s->ntasks, 4);
  EXPECT_EQ(s->procid, 3);
  EXPECT_EQ(s->localid, 1);
  EXPECT_EQ(s->tasks_on_node, 2);
  // A batch script or salloc's shell is not a step.
  auto vars = step_vars();
  vars.erase("SLURM_STEP_NUM_TASKS");
  EXPECT_FALSE(slurm::step(env_of(vars), "R"));
}

TEST(SlurmStep, InconsistentVariablesFailClearly) {
  auto with = [](const char* k, const char* v) {
    auto vars = step_vars();
    vars[k] = v;
    return dtrain_error_of([&] { slurm::step(env_of(vars), "REMEDY"); });
  };
  EXPECT_THAT(with("SLURM_PROCID", "4"),
              HasSubstr("SLURM_PROCID=4 is out of range for SLURM_STEP_NUM_TASKS=4: REMEDY"));
  EXPECT_THAT(with("SLURM_NODEID", "2"),
              HasSubstr("SLURM_NODEID=2 is out of range for SLURM_STEP_TASKS_PER_NODE=2(x2)"));
  EXPECT_THAT(with("SLURM_LOCALID", "2"), HasSubstr("SLURM_LOCALID=2 is out of range for 2 task(s) on node 1"));
  EXPECT_THAT(with("SLURM_LOCALID", ""), HasSubstr("SLURM_LOCALID is not set but SLURM_STEP_NUM_TASKS=4 is: REMEDY"));
  EXPECT_THAT(with("SLURM_STEP_TASKS_PER_NODE", "2(x"), HasSubstr("is not Slurm's task counts"));
}

// The library's side: ranks started by srun meet where the job says, and a batch script is no step.
TEST(SlurmLaunchEnv, SrunRanksWithoutMasterMeetWhereTheJobSays) {
  auto vars = step_vars();
  auto ep = dtrain::comm::master_from_env(env_of(vars), /*under_srun=*/true);
  EXPECT_EQ(ep.host, "n07");
  EXPECT_EQ(ep.port, 18456);
  EXPECT_THAT(ep.note, HasSubstr("export MASTER_ADDR and MASTER_PORT to choose others")) << ep.note;
  // Other launchers inside a Slurm job (mpirun in a batch script) are not guessed for.
  EXPECT_THAT(dtrain_error_of([&] { dtrain::comm::master_from_env(env_of(vars), false); }),
              HasSubstr("MASTER_ADDR is not set"));
  vars["MASTER_ADDR"] = "h";
  vars["MASTER_PORT"] = "2";
  ep = dtrain::comm::master_from_env(env_of(vars), true);
  EXPECT_EQ(ep.host + ":" + std::to_string(ep.port), "h:2");
  EXPECT_EQ(ep.note, "");
}

TEST(SlurmLaunchEnv, ABatchScriptIsNoStep) {
  const std::string e = dtrain_error_of([] {
    dtrain::comm::read_launch_env(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "3"}}));
  });
  EXPECT_EQ(e,
            "SLURM_NTASKS=3 but SLURM_STEP_ID is not set: this is a batch script, not an srun "
            "step, so no other rank will start; start the program with srun (or dtrain-run)");
  // One task needs no peers; an explicit world size is the program's own decision.
  EXPECT_EQ(dtrain::comm::read_launch_env(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}})).world_size, 1);
  EXPECT_EQ(dtrain::comm::read_launch_env(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "3"}}), 0, 1).world_size, 1);
}
