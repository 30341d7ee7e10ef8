// The C API's bad input: every case returns a status and one line naming the function and the
// remedy, never a crash (no C++ exception crosses into C, dead handles are caught). One process,
// a world of one rank (file:// rendezvous). Cases run in declaration order when the program runs
// whole: the first needs no process group yet, the last destroys it.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

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
  dtrain_c_fsdp* fsdp = nullptr;
  EXPECT_STATUS(dtrain_c_fsdp_new(params, 1, nullptr, nullptr, nullptr, nullptr, &fsdp), DTRAIN_C_NOT_INITIALIZED,
                "dtrain_c_fsdp_new: no process group");
  dtrain_c_grad_scaler* scaler = nullptr;
  EXPECT_STATUS(dtrain_c_grad_scaler_new(nullptr, nullptr, &scaler), DTRAIN_C_NOT_INITIALIZED,
                "dtrain_c_grad_scaler_new: no process group");
  const char* names[] = {"w"};
  EXPECT_STATUS(dtrain_c_dcp_save("/tmp/x", names, params, 1, nullptr), DTRAIN_C_NOT_INITIALIZED,
                "dtrain_c_dcp_save: no process group");
  EXPECT_STATUS(dtrain_c_send(h(t), 1, nullptr, 0, nullptr), DTRAIN_C_NOT_INITIALIZED, "dtrain_c_send");
  // The sampler needs no process group when it is told its replicas and rank.
  size_t count = 0;
  EXPECT_EQ(dtrain_c_sampler_indices(10, 4, 3, 1, 0, 0, 0, nullptr, 0, &count), DTRAIN_C_OK) << err();
  EXPECT_EQ(count, 3u);
  EXPECT_STATUS(dtrain_c_sampler_indices(10, -1, -1, 1, 0, 0, 0, nullptr, 0, &count), DTRAIN_C_INVALID_ARGUMENT,
                "dtrain_c_sampler_indices: ");
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

TEST(CApi, SendRecvRefusals) {
  ensure_init();
  at::Tensor t = at::ones({2});
  EXPECT_STATUS(dtrain_c_send(h(t), 0, nullptr, 0, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                "dtrain_c_send on rank 0: dst is 0: pass another rank's global rank in [0, 1)");
  EXPECT_STATUS(dtrain_c_recv(h(t), 3, nullptr, 0, nullptr, nullptr), DTRAIN_C_INVALID_ARGUMENT, "src is 3");
  EXPECT_STATUS(dtrain_c_send(nullptr, 0, nullptr, 0, nullptr), DTRAIN_C_INVALID_ARGUMENT, "tensor is NULL");
  at::Tensor meta = at::empty({2}, at::TensorOptions().device(at::kMeta));
  EXPECT_STATUS(dtrain_c_recv(h(meta), -1, nullptr, 0, nullptr, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                "tensor is on meta");
}

TEST(CApi, FullyShardOverParametersOfOneRank) {
  ensure_init();
  at::Tensor w = at::arange(6, at::kDouble).reshape({3, 2}).requires_grad_();
  at::Tensor b = at::zeros({3}, at::kDouble).requires_grad_();
  dtrain_c_tensor* params[] = {h(w), h(b)};
  const int unit_of[] = {0, DTRAIN_C_FSDP_ROOT};
  dtrain_c_fsdp* fsdp = nullptr;
  ASSERT_EQ(dtrain_c_fsdp_new(params, 2, nullptr, unit_of, nullptr, nullptr, &fsdp), DTRAIN_C_OK) << err();
  at::Tensor x = at::ones({4, 2}, at::kDouble);
  ASSERT_EQ(dtrain_c_fsdp_forward_begin(fsdp, DTRAIN_C_FSDP_ROOT), DTRAIN_C_OK) << err();
  EXPECT_STATUS(dtrain_c_fsdp_forward_begin(fsdp, DTRAIN_C_FSDP_ROOT), DTRAIN_C_INVALID_ARGUMENT,
                "unit -1's forward has begun already");
  ASSERT_EQ(dtrain_c_fsdp_forward_begin(fsdp, 0), DTRAIN_C_OK) << err();
  at::Tensor y = at::linear(x, w, b);
  EXPECT_STATUS(dtrain_c_fsdp_forward_end(fsdp, DTRAIN_C_FSDP_ROOT, nullptr, 0), DTRAIN_C_INVALID_ARGUMENT,
                "the root's forward ends while a unit's is open");
  ASSERT_EQ(dtrain_c_fsdp_forward_end(fsdp, 0, std::vector<dtrain_c_tensor*>{h(y)}.data(), 1), DTRAIN_C_OK) << err();
  at::Tensor loss = y.sum();
  ASSERT_EQ(dtrain_c_fsdp_forward_end(fsdp, DTRAIN_C_FSDP_ROOT, std::vector<dtrain_c_tensor*>{h(loss)}.data(), 1),
            DTRAIN_C_OK)
      << err();
  loss.backward();
  // One rank: the shard is the whole, and the gradient is one process's.
  EXPECT_TRUE(w.grad().equal(at::full({3, 2}, 4.0, at::kDouble)));
  EXPECT_TRUE(b.grad().equal(at::full({3}, 4.0, at::kDouble)));
  at::Tensor whole = at::zeros({3, 2}, at::kDouble);
  ASSERT_EQ(dtrain_c_fsdp_full_parameter(fsdp, 0, h(whole)), DTRAIN_C_OK) << err();
  EXPECT_TRUE(whole.equal(at::arange(6, at::kDouble).reshape({3, 2})));
  at::Tensor wrong = at::zeros({2, 3}, at::kDouble);
  EXPECT_STATUS(dtrain_c_fsdp_full_parameter(fsdp, 0, h(wrong)), DTRAIN_C_INVALID_ARGUMENT,
                "out is Double [2, 3] but parameter 0 is Double [3, 2]");
  EXPECT_STATUS(dtrain_c_fsdp_full_parameter(fsdp, 7, h(whole)), DTRAIN_C_INVALID_ARGUMENT, "index is 7");
  EXPECT_STATUS(dtrain_c_fsdp_unshard(fsdp, 4), DTRAIN_C_INVALID_ARGUMENT,
                "unit is 4: pass DTRAIN_C_FSDP_ROOT (-1) or a unit in [0, 1)");
  EXPECT_STATUS(dtrain_c_fsdp_forward_end(fsdp, 0, nullptr, 0), DTRAIN_C_INVALID_ARGUMENT,
                "unit 0's forward has not begun");
  EXPECT_STATUS(dtrain_c_fsdp_forward_begin(fsdp, 0), DTRAIN_C_INVALID_ARGUMENT,
                "unit 0's forward begins outside the root's");
  ASSERT_EQ(dtrain_c_fsdp_unshard(fsdp, 0), DTRAIN_C_OK) << err();
  ASSERT_EQ(dtrain_c_fsdp_reshard(fsdp, 0), DTRAIN_C_OK) << err();
  ASSERT_EQ(dtrain_c_fsdp_free(fsdp), DTRAIN_C_OK) << err();
  EXPECT_STATUS(dtrain_c_fsdp_forward_begin(fsdp, DTRAIN_C_FSDP_ROOT), DTRAIN_C_INVALID_HANDLE,
                "is not a live fsdp handle");
  EXPECT_STATUS(dtrain_c_fsdp_free(fsdp), DTRAIN_C_INVALID_HANDLE, "is not a live fsdp handle");
}

TEST(CApi, FullyShardRefusals) {
  ensure_init();
  at::Tensor leaf = at::ones({2}).requires_grad_();
  at::Tensor ints = at::ones({2}, at::kLong);
  dtrain_c_fsdp* fsdp = nullptr;
  dtrain_c_tensor* bad_dtype[] = {h(leaf), h(ints)};
  EXPECT_STATUS(dtrain_c_fsdp_new(bad_dtype, 2, nullptr, nullptr, nullptr, nullptr, &fsdp), DTRAIN_C_INVALID_ARGUMENT,
                "dtrain_c_fsdp_new on rank 0: params[1] is Long: fully_shard shards floating-point parameters");
  at::Tensor leaf2 = at::ones({2}).requires_grad_();
  dtrain_c_tensor* two[] = {h(leaf), h(leaf2)};
  const int gap[] = {1, 1};
  EXPECT_STATUS(dtrain_c_fsdp_new(two, 2, nullptr, gap, nullptr, nullptr, &fsdp), DTRAIN_C_INVALID_ARGUMENT,
                "unit 0 has no parameter");
  const int past[] = {0, 2};
  EXPECT_STATUS(dtrain_c_fsdp_new(two, 2, nullptr, past, nullptr, nullptr, &fsdp), DTRAIN_C_INVALID_ARGUMENT,
                "unit_of[1] is 2: pass -1 (the root) or a unit in [0, 2)");
  const int negative[] = {0, -3};
  EXPECT_STATUS(dtrain_c_fsdp_new(two, 2, nullptr, negative, nullptr, nullptr, &fsdp), DTRAIN_C_INVALID_ARGUMENT,
                "unit_of[1] is -3");
  const char* same[] = {"w", "w"};
  EXPECT_STATUS(dtrain_c_fsdp_new(two, 2, same, nullptr, nullptr, nullptr, &fsdp), DTRAIN_C_INVALID_ARGUMENT,
                "names[1] 'w' repeats names[0]");
  dtrain_c_fsdp_options options{};
  EXPECT_STATUS(dtrain_c_fsdp_new(two, 2, nullptr, nullptr, &options, nullptr, &fsdp), DTRAIN_C_INVALID_ARGUMENT,
                "struct_size is 0");
  dtrain_c_fsdp_options_default(&options);
  options.reshard_after_forward = -4;
  EXPECT_STATUS(dtrain_c_fsdp_new(two, 2, nullptr, nullptr, &options, nullptr, &fsdp), DTRAIN_C_INVALID_ARGUMENT,
                "reshard_after_forward is -4");
  EXPECT_STATUS(dtrain_c_fsdp_new(two, 2, nullptr, nullptr, nullptr, nullptr, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                "out is NULL");
  EXPECT_STATUS(dtrain_c_fsdp_unshard(nullptr, 0), DTRAIN_C_INVALID_HANDLE, "fsdp is NULL");
  EXPECT_STATUS(dtrain_c_fsdp_set_requires_gradient_sync(nullptr, 1), DTRAIN_C_INVALID_HANDLE, "fsdp is NULL");
}

TEST(CApi, SamplerAndClipGradNorm) {
  ensure_init();
  size_t count = 0;
  EXPECT_STATUS(dtrain_c_sampler_indices(10, 2, 0, 0, 0, 0, 0, nullptr, 0, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                "count is NULL");
  int64_t few[2];
  EXPECT_STATUS(dtrain_c_sampler_indices(10, 2, 1, 0, 0, 0, 0, few, 2, &count), DTRAIN_C_INVALID_ARGUMENT,
                "capacity is 2 but this rank has 5 indices");
  EXPECT_STATUS(dtrain_c_sampler_indices(10, 2, 2, 0, 0, 0, 0, few, 2, &count), DTRAIN_C_INVALID_ARGUMENT, "rank");
  int64_t all[5];
  ASSERT_EQ(dtrain_c_sampler_indices(10, 2, 1, 0, 0, 0, 0, all, 5, &count), DTRAIN_C_OK) << err();
  EXPECT_EQ(std::vector<int64_t>(all, all + 5), (std::vector<int64_t>{1, 3, 5, 7, 9}));  // no shuffle: r, r + N, ...

  at::Tensor p = at::zeros({2}).requires_grad_();
  p.mutable_grad() = at::tensor({3.0f, 4.0f});
  dtrain_c_tensor* params[] = {h(p)};
  double total = 0;
  ASSERT_EQ(dtrain_c_clip_grad_norm_(params, 1, 1.0, 2.0, &total), DTRAIN_C_OK) << err();
  EXPECT_DOUBLE_EQ(total, 5.0);
  EXPECT_NEAR(p.grad()[1].item<double>(), 4.0 / (5.0 + 1e-6), 1e-6);
  EXPECT_STATUS(dtrain_c_clip_grad_norm_(params, 1, -1.0, 2.0, &total), DTRAIN_C_INVALID_ARGUMENT, "max_norm is -1");
  EXPECT_STATUS(dtrain_c_clip_grad_norm_(params, 1, 1.0, 0.0, &total), DTRAIN_C_INVALID_ARGUMENT, "norm_type is 0");
  EXPECT_STATUS(dtrain_c_clip_grad_norm_(nullptr, 1, 1.0, 2.0, &total), DTRAIN_C_INVALID_ARGUMENT, "params is NULL");
  at::Tensor ints = at::ones({2}, at::kLong);
  dtrain_c_tensor* wrong[] = {h(ints)};
  EXPECT_STATUS(dtrain_c_clip_grad_norm_(wrong, 1, 1.0, 2.0, &total), DTRAIN_C_INVALID_ARGUMENT, "params[0] is Long");
}

TEST(CApi, GradScalerSkipsOnInfAndRefuses) {
  ensure_init();
  dtrain_c_grad_scaler_options options{};
  dtrain_c_grad_scaler* scaler = nullptr;
  EXPECT_STATUS(dtrain_c_grad_scaler_new(&options, nullptr, &scaler), DTRAIN_C_INVALID_ARGUMENT, "struct_size is 0");
  dtrain_c_grad_scaler_options_default(&options);
  EXPECT_EQ(options.init_scale, 65536.0);
  options.backoff_factor = 2;
  EXPECT_STATUS(dtrain_c_grad_scaler_new(&options, nullptr, &scaler), DTRAIN_C_INVALID_ARGUMENT, "backoff_factor 2");
  ASSERT_EQ(dtrain_c_grad_scaler_new(nullptr, nullptr, &scaler), DTRAIN_C_OK) << err();
  at::Tensor p = at::ones({2}).requires_grad_();
  dtrain_c_tensor* params[] = {h(p)};
  at::Tensor ints = at::ones({}, at::kLong);
  dtrain_c_tensor* scaled = nullptr;
  EXPECT_STATUS(dtrain_c_grad_scaler_scale(scaler, h(ints), &scaled), DTRAIN_C_INVALID_ARGUMENT, "loss is Long");
  at::Tensor loss = (p * 2).sum();
  ASSERT_EQ(dtrain_c_grad_scaler_scale(scaler, h(loss), &scaled), DTRAIN_C_OK) << err();
  EXPECT_DOUBLE_EQ(reinterpret_cast<at::Tensor*>(scaled)->item<double>(), 4.0 * 65536);
  reinterpret_cast<at::Tensor*>(scaled)->backward();
  ASSERT_EQ(dtrain_c_tensor_free(scaled), DTRAIN_C_OK);
  ASSERT_EQ(dtrain_c_grad_scaler_unscale_(scaler, params, 1), DTRAIN_C_OK) << err();
  EXPECT_TRUE(p.grad().equal(at::full({2}, 2.0f)));
  EXPECT_STATUS(dtrain_c_grad_scaler_unscale_(scaler, params, 1), DTRAIN_C_DIST_ERROR, "already been called");
  int should_step = -1;
  EXPECT_STATUS(dtrain_c_grad_scaler_step(scaler, params, 1, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                "should_step is NULL");
  ASSERT_EQ(dtrain_c_grad_scaler_step(scaler, params, 1, &should_step), DTRAIN_C_OK) << err();
  EXPECT_EQ(should_step, 1);
  ASSERT_EQ(dtrain_c_grad_scaler_update(scaler, 0), DTRAIN_C_OK) << err();
  // An inf gradient: skip, and the scale backs off.
  loss = (p * 2).sum();
  ASSERT_EQ(dtrain_c_grad_scaler_scale(scaler, h(loss), &scaled), DTRAIN_C_OK) << err();
  ASSERT_EQ(dtrain_c_tensor_free(scaled), DTRAIN_C_OK);
  p.mutable_grad() = at::tensor({1.0f, std::numeric_limits<float>::infinity()});
  ASSERT_EQ(dtrain_c_grad_scaler_step(scaler, params, 1, &should_step), DTRAIN_C_OK) << err();
  EXPECT_EQ(should_step, 0);
  ASSERT_EQ(dtrain_c_grad_scaler_update(scaler, 0), DTRAIN_C_OK) << err();
  double scale = 0;
  ASSERT_EQ(dtrain_c_grad_scaler_get_scale(scaler, &scale), DTRAIN_C_OK) << err();
  EXPECT_EQ(scale, 32768.0);
  EXPECT_STATUS(dtrain_c_grad_scaler_update(scaler, -2), DTRAIN_C_INVALID_ARGUMENT, "new_scale is -2");
  ASSERT_EQ(dtrain_c_grad_scaler_free(scaler), DTRAIN_C_OK);
  EXPECT_STATUS(dtrain_c_grad_scaler_get_scale(scaler, &scale), DTRAIN_C_INVALID_HANDLE,
                "is not a live grad scaler handle");
  EXPECT_STATUS(dtrain_c_grad_scaler_step(nullptr, params, 1, &should_step), DTRAIN_C_INVALID_HANDLE, "scaler is NULL");
}

TEST(CApi, DcpRoundTripAndRefusals) {
  ensure_init();
  const std::string dir = "/tmp/dtrain_c_api_test_dcp_" + std::to_string(getpid());
  at::Tensor a = at::arange(6, at::kFloat).reshape({2, 3});
  at::Tensor b = at::ones({4}, at::kDouble);
  const char* names[] = {"layer.weight", "step"};
  dtrain_c_tensor* tensors[] = {h(a), h(b)};
  ASSERT_EQ(dtrain_c_dcp_save(dir.c_str(), names, tensors, 2, nullptr), DTRAIN_C_OK) << err();
  at::Tensor a2 = at::zeros({2, 3});
  at::Tensor b2 = at::zeros({4}, at::kDouble);
  dtrain_c_tensor* into[] = {h(a2), h(b2)};
  ASSERT_EQ(dtrain_c_dcp_load(dir.c_str(), names, into, 2, nullptr), DTRAIN_C_OK) << err();
  EXPECT_TRUE(a2.equal(a));
  EXPECT_TRUE(b2.equal(b));
  at::Tensor wrong = at::zeros({3, 2});
  dtrain_c_tensor* wrong_shape[] = {h(wrong)};
  EXPECT_STATUS(dtrain_c_dcp_load(dir.c_str(), names, wrong_shape, 1, nullptr), DTRAIN_C_IO_ERROR,
                "dtrain_c_dcp_load on rank 0: ");
  EXPECT_TRUE(wrong.equal(at::zeros({3, 2})));  // nothing loaded
  const char* twice[] = {"step", "step"};
  EXPECT_STATUS(dtrain_c_dcp_save(dir.c_str(), twice, tensors, 2, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                "'step' repeats names[0]");
  EXPECT_STATUS(dtrain_c_dcp_save(nullptr, names, tensors, 2, nullptr), DTRAIN_C_INVALID_ARGUMENT, "dir is NULL");
  EXPECT_STATUS(dtrain_c_dcp_load("/nonexistent/ckpt", names, into, 2, nullptr), DTRAIN_C_IO_ERROR,
                "dtrain_c_dcp_load on rank 0: ");
  dtrain_c_tensor* with_null[] = {h(a2), nullptr};
  EXPECT_STATUS(dtrain_c_dcp_load(dir.c_str(), names, with_null, 2, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                "tensors[1] is NULL");
  dtrain_c_group* dead = nullptr;
  const int ranks[] = {0};
  ASSERT_EQ(dtrain_c_new_group(ranks, 1, &dead), DTRAIN_C_OK) << err();
  ASSERT_EQ(dtrain_c_group_free(dead), DTRAIN_C_OK);
  EXPECT_STATUS(dtrain_c_dcp_save(dir.c_str(), names, tensors, 2, dead), DTRAIN_C_INVALID_HANDLE,
                "is not a live group handle");
  std::system(("rm -rf " + dir).c_str());
}

TEST(CApi, MonitorStepsAndRefusals) {
  ensure_init();
  const std::string dir = "/tmp/dtrain_c_api_test_monitor_" + std::to_string(getpid());
  dtrain_c_monitor* monitor = nullptr;
  EXPECT_STATUS(dtrain_c_monitor_new(dir.c_str(), -1, 0, nullptr, &monitor), DTRAIN_C_INVALID_ARGUMENT,
                "log_every is -1");
  ASSERT_EQ(dtrain_c_monitor_new(dir.c_str(), 3, 0, nullptr, &monitor), DTRAIN_C_OK) << err();
  at::Tensor p = at::ones({3}).requires_grad_();
  p.mutable_grad() = at::full({3}, 2.0f);
  dtrain_c_tensor* params[] = {h(p)};
  ASSERT_EQ(dtrain_c_monitor_watch_parameters(monitor, params, 1, nullptr), DTRAIN_C_OK) << err();
  for (int step = 0; step < 3; ++step) {
    ASSERT_EQ(dtrain_c_monitor_begin_step(monitor), DTRAIN_C_OK) << err();
    ASSERT_EQ(dtrain_c_monitor_phase_begin(monitor, DTRAIN_C_PHASE_FORWARD), DTRAIN_C_OK) << err();
    EXPECT_STATUS(dtrain_c_monitor_phase_begin(monitor, DTRAIN_C_PHASE_BACKWARD), DTRAIN_C_INVALID_ARGUMENT,
                  "phase 0 is still open");
    EXPECT_STATUS(dtrain_c_monitor_end_step(monitor, 1.0, 4, 0.1), DTRAIN_C_INVALID_ARGUMENT, "phase 0 is still open");
    EXPECT_STATUS(dtrain_c_monitor_phase_end(monitor, DTRAIN_C_PHASE_OPTIMIZER), DTRAIN_C_INVALID_ARGUMENT,
                  "phase 2 is not open (open: 0)");
    ASSERT_EQ(dtrain_c_monitor_phase_end(monitor, DTRAIN_C_PHASE_FORWARD), DTRAIN_C_OK) << err();
    ASSERT_EQ(dtrain_c_monitor_end_step(monitor, 0.5 * step, 4, 0.1), DTRAIN_C_OK) << err();
  }
  dtrain_c_step_metrics m{};
  EXPECT_STATUS(dtrain_c_monitor_last_step(monitor, &m), DTRAIN_C_INVALID_ARGUMENT, "struct_size is 0");
  m.struct_size = sizeof m;
  ASSERT_EQ(dtrain_c_monitor_last_step(monitor, &m), DTRAIN_C_OK) << err();
  EXPECT_EQ(m.step, 3);
  EXPECT_EQ(m.loss, 1.0);
  EXPECT_EQ(m.samples, 4);
  EXPECT_NEAR(m.grad_norm, std::sqrt(12.0), 1e-6);  // the watched gradient's, on a window's last step
  EXPECT_GE(m.forward_ms, 0.0);
  EXPECT_STATUS(dtrain_c_monitor_phase_begin(monitor, static_cast<dtrain_c_phase>(7)), DTRAIN_C_INVALID_ARGUMENT,
                "phase is 7");
  EXPECT_STATUS(dtrain_c_monitor_end_step(monitor, 1.0, -4, 0.1), DTRAIN_C_INVALID_ARGUMENT, "samples is -4");
  ASSERT_EQ(dtrain_c_monitor_close(monitor), DTRAIN_C_OK) << err();
  EXPECT_EQ(access((dir + "/metrics.jsonl").c_str(), R_OK), 0) << "no metrics.jsonl in " << dir;
  ASSERT_EQ(dtrain_c_monitor_free(monitor), DTRAIN_C_OK);
  EXPECT_STATUS(dtrain_c_monitor_last_step(monitor, &m), DTRAIN_C_INVALID_HANDLE, "is not a live monitor handle");
  EXPECT_STATUS(dtrain_c_monitor_begin_step(nullptr), DTRAIN_C_INVALID_HANDLE, "monitor is NULL");
  std::system(("rm -rf " + dir).c_str());
}

// Last: the process group ends, and every handle with it.
TEST(CApi, DestroyEndsEveryHandle) {
  ensure_init();
  at::Tensor t = at::ones({2});
  dtrain_c_work* work = nullptr;
  ASSERT_EQ(dtrain_c_all_reduce(h(t), DTRAIN_C_SUM, nullptr, &work), DTRAIN_C_OK) << err();
  ASSERT_EQ(dtrain_c_work_wait(work), DTRAIN_C_OK) << err();
  dtrain_c_grad_scaler* scaler = nullptr;
  ASSERT_EQ(dtrain_c_grad_scaler_new(nullptr, nullptr, &scaler), DTRAIN_C_OK) << err();
  ASSERT_EQ(dtrain_c_destroy_process_group(), DTRAIN_C_OK) << err();
  EXPECT_STATUS(dtrain_c_work_wait(work), DTRAIN_C_INVALID_HANDLE, "dtrain_c_work_wait: work");
  double scale = 0;
  EXPECT_STATUS(dtrain_c_grad_scaler_get_scale(scaler, &scale), DTRAIN_C_INVALID_HANDLE, "not a live grad scaler");
  int r = 0;
  EXPECT_STATUS(dtrain_c_rank(&r), DTRAIN_C_NOT_INITIALIZED, "dtrain_c_rank: no process group");
}

}  // namespace
