// The C API's bad input: every case returns a status and one line naming the function and the
// remedy, never a crash (no C++ exception crosses into C, dead handles are caught). One process,
// a world of one rank (file:// rendezvous). Cases run in declaration order when the program runs
// whole: the first needs no process group yet, the last destroys it.
#include <unistd.h>

#include <cstdio>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtrain_c.h"

namespace {

dtrain_c_tensor* h(at::Tensor& t) { return reinterpret_cast<dtrain_c_tensor*>(&t); }
std::string err() { return dtrain_c_last_error(); }

void ensure_init() {
  if (dtrain_c_is_initialized()) return;
  static int n = 0;
  const std::string file = "/tmp/dtrain_c_api_test_" + std::to_string(getpid()) + "_" + std::to_string(n++);
  std::remove(file.c_str());
  ASSERT_EQ(dtrain_c_init_process_group("gloo", ("file://" + file).c_str(), 0, 1, 60000), DTRAIN_C_OK) << err();
}

#define EXPECT_STATUS(call, status, text)                                      \
  do {                                                                         \
    EXPECT_EQ((call), (status));                                               \
    EXPECT_NE(err().find(text), std::string::npos) << "last error: " << err(); \
  } while (0)

TEST(CApi, EveryCallBeforeInitIsRefused) {
  ASSERT_FALSE(dtrain_c_is_initialized()) << "this case must run before any other initializes";
  EXPECT_EQ(dtrain_c_abi_version(), DTRAIN_C_ABI_VERSION);
  int r = -1;
  EXPECT_STATUS(dtrain_c_rank(&r), DTRAIN_C_NOT_INITIALIZED, "dtrain_c_rank: no process group: call dtrain_c_init");
  EXPECT_STATUS(dtrain_c_local_rank(&r), DTRAIN_C_NOT_INITIALIZED, "dtrain_c_local_rank");
  at::Tensor t = at::ones({4});
  EXPECT_STATUS(dtrain_c_all_reduce(h(t), DTRAIN_C_SUM, nullptr, nullptr), DTRAIN_C_NOT_INITIALIZED,
                "dtrain_c_all_reduce: no process group");
  at::Tensor p = at::ones({2}).requires_grad_();
  dtrain_c_tensor* params[] = {h(p)};
  dtrain_c_ddp* ddp = nullptr;
  EXPECT_STATUS(dtrain_c_ddp_new(params, 1, nullptr, nullptr, nullptr, &ddp), DTRAIN_C_NOT_INITIALIZED,
                "dtrain_c_ddp_new");
  dtrain_c_group* g = nullptr;
  EXPECT_STATUS(dtrain_c_new_group(nullptr, 0, &g), DTRAIN_C_NOT_INITIALIZED, "dtrain_c_new_group");
  EXPECT_STATUS(dtrain_c_barrier(nullptr, nullptr), DTRAIN_C_NOT_INITIALIZED, "dtrain_c_barrier");
  EXPECT_STATUS(dtrain_c_destroy_process_group(), DTRAIN_C_NOT_INITIALIZED, "dtrain_c_destroy_process_group");
  EXPECT_STATUS(dtrain_c_init_process_group(nullptr, nullptr, -1, -1, -5), DTRAIN_C_INVALID_ARGUMENT,
                "timeout_ms is -5");
}

TEST(CApi, NullArgumentsAndHandles) {
  ensure_init();
  EXPECT_STATUS(dtrain_c_rank(nullptr), DTRAIN_C_INVALID_ARGUMENT, "dtrain_c_rank on rank 0: out is NULL");
  EXPECT_STATUS(dtrain_c_all_reduce(nullptr, DTRAIN_C_SUM, nullptr, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                "tensor is NULL: pass an at::Tensor*");
  at::Tensor undefined;
  EXPECT_STATUS(dtrain_c_broadcast(h(undefined), 0, nullptr, nullptr), DTRAIN_C_INVALID_ARGUMENT, "undefined tensor");
  EXPECT_STATUS(dtrain_c_work_wait(nullptr), DTRAIN_C_INVALID_HANDLE, "work is NULL");
  EXPECT_STATUS(dtrain_c_work_free(nullptr), DTRAIN_C_INVALID_HANDLE, "work is NULL");
  EXPECT_STATUS(dtrain_c_ddp_forward_begin(nullptr), DTRAIN_C_INVALID_HANDLE, "ddp is NULL");
  EXPECT_STATUS(dtrain_c_ddp_free(nullptr), DTRAIN_C_INVALID_HANDLE, "ddp is NULL");
  EXPECT_STATUS(dtrain_c_group_free(nullptr), DTRAIN_C_INVALID_HANDLE, "group is NULL");
  EXPECT_STATUS(dtrain_c_ddp_new(nullptr, 0, nullptr, nullptr, nullptr, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                "out is NULL");
  dtrain_c_ddp* ddp = nullptr;
  EXPECT_STATUS(dtrain_c_ddp_new(nullptr, 1, nullptr, nullptr, nullptr, &ddp), DTRAIN_C_INVALID_ARGUMENT,
                "params is NULL");
  EXPECT_STATUS(dtrain_c_save_safetensors(nullptr, nullptr, nullptr, 0), DTRAIN_C_INVALID_ARGUMENT, "path is NULL");
  EXPECT_STATUS(dtrain_c_tensor_from_impl(nullptr, nullptr), DTRAIN_C_INVALID_ARGUMENT, "impl is NULL");
  // A success clears the thread's last error.
  int r = -1;
  EXPECT_EQ(dtrain_c_rank(&r), DTRAIN_C_OK);
  EXPECT_EQ(r, 0);
  EXPECT_EQ(err(), "");
}

TEST(CApi, WrongDtypeDeviceAndValues) {
  ensure_init();
  at::Tensor meta = at::empty({4}, at::TensorOptions().device(at::kMeta));
  EXPECT_STATUS(dtrain_c_all_reduce(h(meta), DTRAIN_C_SUM, nullptr, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                "tensor is on meta but the group's backend gloo takes tensors on cpu");
  at::Tensor t = at::ones({4});
  EXPECT_STATUS(dtrain_c_all_reduce(h(t), static_cast<dtrain_c_reduce_op>(99), nullptr, nullptr),
                DTRAIN_C_INVALID_ARGUMENT, "op is 99");
  at::Tensor out = at::zeros({4}, at::kDouble);
  EXPECT_STATUS(dtrain_c_all_gather_into_tensor(h(out), h(t), nullptr, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                "output is Double but input is Float");
  at::Tensor strided = at::ones({4, 4}).t();
  EXPECT_STATUS(dtrain_c_all_reduce(h(strided), DTRAIN_C_SUM, nullptr, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                "not contiguous");
  // A distributed failure names the rank and the operation.
  EXPECT_STATUS(dtrain_c_broadcast(h(t), 5, nullptr, nullptr), DTRAIN_C_DIST_ERROR, "dtrain_c_broadcast on rank 0: ");

  at::Tensor ints = at::ones({2}, at::kLong);
  at::Tensor leaf = at::ones({2}).requires_grad_();
  at::Tensor not_leaf = leaf * 2;
  at::Tensor no_grad = at::ones({2});
  dtrain_c_ddp* ddp = nullptr;
  dtrain_c_tensor* bad_dtype[] = {h(leaf), h(ints)};
  EXPECT_STATUS(dtrain_c_ddp_new(bad_dtype, 2, nullptr, nullptr, nullptr, &ddp), DTRAIN_C_INVALID_ARGUMENT,
                "params[1] is Long: DDP averages gradients of floating-point parameters");
  dtrain_c_tensor* bad_leaf[] = {h(not_leaf)};
  EXPECT_STATUS(dtrain_c_ddp_new(bad_leaf, 1, nullptr, nullptr, nullptr, &ddp), DTRAIN_C_INVALID_ARGUMENT,
                "params[0] is not a leaf tensor with requires_grad");
  dtrain_c_tensor* bad_grad[] = {h(no_grad)};
  EXPECT_STATUS(dtrain_c_ddp_new(bad_grad, 1, nullptr, nullptr, nullptr, &ddp), DTRAIN_C_INVALID_ARGUMENT,
                "params[0] is not a leaf tensor with requires_grad");
  dtrain_c_tensor* good[] = {h(leaf)};
  const char* dotted[] = {"fc.weight"};
  EXPECT_STATUS(dtrain_c_ddp_new(good, 1, dotted, nullptr, nullptr, &ddp), DTRAIN_C_INVALID_ARGUMENT,
                "names[0] is 'fc.weight': a parameter name has no '.'");
  dtrain_c_ddp_options options{};  // not filled by dtrain_c_ddp_options_default
  EXPECT_STATUS(dtrain_c_ddp_new(good, 1, nullptr, &options, nullptr, &ddp), DTRAIN_C_INVALID_ARGUMENT,
                "struct_size is 0");
  dtrain_c_ddp_options_default(&options);
  options.bucket_cap_mb = -1;
  EXPECT_STATUS(dtrain_c_ddp_new(good, 1, nullptr, &options, nullptr, &ddp), DTRAIN_C_DIST_ERROR,
                "bucket_cap_mb must be > 0, got -1");
}

TEST(CApi, UseAfterFreeAndHandlesOfAnotherKind) {
  ensure_init();
  at::Tensor t = at::ones({4});
  dtrain_c_work* work = nullptr;
  ASSERT_EQ(dtrain_c_all_reduce(h(t), DTRAIN_C_SUM, nullptr, &work), DTRAIN_C_OK) << err();
  ASSERT_EQ(dtrain_c_work_wait(work), DTRAIN_C_OK) << err();
  int done = 0;
  ASSERT_EQ(dtrain_c_work_is_completed(work, &done), DTRAIN_C_OK) << err();
  EXPECT_EQ(done, 1);
  ASSERT_EQ(dtrain_c_work_free(work), DTRAIN_C_OK);
  EXPECT_STATUS(dtrain_c_work_wait(work), DTRAIN_C_INVALID_HANDLE, "is not a live work handle");
  EXPECT_STATUS(dtrain_c_work_is_completed(work, &done), DTRAIN_C_INVALID_HANDLE, "is not a live work handle");
  EXPECT_STATUS(dtrain_c_work_free(work), DTRAIN_C_INVALID_HANDLE, "is not a live work handle");

  const int ranks[] = {0};
  dtrain_c_group* group = nullptr;
  ASSERT_EQ(dtrain_c_new_group(ranks, 1, &group), DTRAIN_C_OK) << err();
  int size = 0;
  ASSERT_EQ(dtrain_c_group_size(group, &size), DTRAIN_C_OK);
  EXPECT_EQ(size, 1);
  EXPECT_STATUS(dtrain_c_work_wait(reinterpret_cast<dtrain_c_work*>(group)), DTRAIN_C_INVALID_HANDLE,
                "not a live work handle");
  ASSERT_EQ(dtrain_c_group_free(group), DTRAIN_C_OK);
  EXPECT_STATUS(dtrain_c_all_reduce(h(t), DTRAIN_C_SUM, group, nullptr), DTRAIN_C_INVALID_HANDLE,
                "is not a live group handle");

  at::Tensor p = at::ones({3}).requires_grad_();
  dtrain_c_tensor* params[] = {h(p)};
  dtrain_c_ddp* ddp = nullptr;
  ASSERT_EQ(dtrain_c_ddp_new(params, 1, nullptr, nullptr, nullptr, &ddp), DTRAIN_C_OK) << err();
  EXPECT_STATUS(dtrain_c_ddp_no_sync_end(ddp), DTRAIN_C_INVALID_ARGUMENT, "not inside no_sync");
  ASSERT_EQ(dtrain_c_ddp_free(ddp), DTRAIN_C_OK);
  EXPECT_STATUS(dtrain_c_ddp_forward_begin(ddp), DTRAIN_C_INVALID_HANDLE, "is not a live ddp handle");
  EXPECT_STATUS(dtrain_c_ddp_free(ddp), DTRAIN_C_INVALID_HANDLE, "is not a live ddp handle");

  // Tensors: only those dtrain_c_tensor_from_impl made, once.
  dtrain_c_tensor* made = nullptr;
  ASSERT_EQ(dtrain_c_tensor_from_impl(t.unsafeGetTensorImpl(), &made), DTRAIN_C_OK);
  EXPECT_EQ(reinterpret_cast<at::Tensor*>(made)->data_ptr(), t.data_ptr());
  ASSERT_EQ(dtrain_c_tensor_free(made), DTRAIN_C_OK);
  EXPECT_STATUS(dtrain_c_tensor_free(made), DTRAIN_C_INVALID_HANDLE, "was not made by dtrain_c_tensor_from_impl");
  EXPECT_STATUS(dtrain_c_tensor_free(h(t)), DTRAIN_C_INVALID_HANDLE, "was not made by dtrain_c_tensor_from_impl");
}

TEST(CApi, SafetensorsRoundTripAndRefusals) {
  ensure_init();
  const std::string path = "/tmp/dtrain_c_api_test_" + std::to_string(getpid()) + ".safetensors";
  at::Tensor a = at::arange(6, at::kFloat).reshape({2, 3});
  at::Tensor b = at::ones({4}, at::kDouble);
  const char* names[] = {"layer.weight", "step"};
  dtrain_c_tensor* tensors[] = {h(a), h(b)};
  ASSERT_EQ(dtrain_c_save_safetensors(path.c_str(), names, tensors, 2), DTRAIN_C_OK) << err();
  at::Tensor a2 = at::zeros({2, 3});
  at::Tensor b2 = at::zeros({4}, at::kDouble);
  dtrain_c_tensor* into[] = {h(a2), h(b2)};
  ASSERT_EQ(dtrain_c_load_safetensors(path.c_str(), names, into, 2), DTRAIN_C_OK) << err();
  EXPECT_TRUE(a2.equal(a));
  EXPECT_TRUE(b2.equal(b));

  at::Tensor wrong = at::zeros({3, 2});
  dtrain_c_tensor* wrong_shape[] = {h(wrong), h(b2)};
  EXPECT_STATUS(dtrain_c_load_safetensors(path.c_str(), names, wrong_shape, 2), DTRAIN_C_INVALID_ARGUMENT,
                "'layer.weight' is [2, 3] in the file but [3, 2] here");
  EXPECT_TRUE(wrong.equal(at::zeros({3, 2})));  // nothing loaded
  EXPECT_STATUS(dtrain_c_load_safetensors(path.c_str(), names, into, 1), DTRAIN_C_INVALID_ARGUMENT,
                "unexpected in the file: 'step'");
  const char* twice[] = {"step", "step"};
  EXPECT_STATUS(dtrain_c_save_safetensors(path.c_str(), twice, tensors, 2), DTRAIN_C_INVALID_ARGUMENT,
                "'step' repeats names[0]");
  EXPECT_STATUS(dtrain_c_load_safetensors("/nonexistent/x.safetensors", names, into, 2), DTRAIN_C_IO_ERROR,
                "dtrain_c_load_safetensors on rank 0: ");
  std::remove(path.c_str());
}

// Last: the process group ends, and every handle with it.
TEST(CApi, DestroyEndsEveryHandle) {
  ensure_init();
  at::Tensor t = at::ones({2});
  dtrain_c_work* work = nullptr;
  ASSERT_EQ(dtrain_c_all_reduce(h(t), DTRAIN_C_SUM, nullptr, &work), DTRAIN_C_OK) << err();
  ASSERT_EQ(dtrain_c_work_wait(work), DTRAIN_C_OK) << err();
  ASSERT_EQ(dtrain_c_destroy_process_group(), DTRAIN_C_OK) << err();
  EXPECT_STATUS(dtrain_c_work_wait(work), DTRAIN_C_INVALID_HANDLE, "dtrain_c_work_wait: work");
  int r = 0;
  EXPECT_STATUS(dtrain_c_rank(&r), DTRAIN_C_NOT_INITIALIZED, "dtrain_c_rank: no process group");
}

}  // namespace
