// The C++ side of Stagehand's libtorch substrate. Compiled by build.rs against the headers of
// the installed libtorch (it must be rebuilt for another torch version).
//
// 1. Saved-tensor hooks. libtorch's public default hooks only hold Python objects, so we
//    subclass torch::autograd::Engine, override get_default_saved_variable_hooks() to return our
//    hooks while a thread-local context is set, and install the subclass as the default engine
//    before the first backward. Pack runs on the forward thread; unpack and release may run on
//    the engine's worker threads, so each hooks object carries its own reference to the context.
//    Rust callbacks report failure through a status code and a message; we turn that into a
//    c10::Error, so a failing hook surfaces as a torch error, never as an abort or an unwind
//    across the FFI boundary.
// 2. Device allocator statistics (allocated/reserved/active, current and peak), peak reset,
//    empty cache, and free/total memory: the VRAM signal for watermarks.
// 3. libtorch's optimizers (SGD, Adam, AdamW, RMSprop) made as tch makes them, with what tch
//    does not expose: the options of each parameter group, and each parameter's state (read
//    for checkpoints, written when one is loaded).

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/_scaled_dot_product_flash_attention.h>
#include <ATen/ops/_fused_sgd.h>
#include <ATen/ops/empty.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <vector>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>

namespace {

constexpr size_t kErrLen = 1024;

// Callbacks into Rust. Each returns 0 on success, or non-zero with a message in `err` (pack: 2
// for a recomputation's early stop).
struct Callbacks {
  // Takes ownership of `tensor` (a heap at::Tensor). Writes the handle.
  int (*pack)(void* ctx, at::Tensor* tensor, uint64_t* handle, char* err, size_t err_len);
  // Writes a heap at::Tensor whose ownership passes to C++.
  int (*unpack)(void* ctx, uint64_t handle, at::Tensor** out, char* err, size_t err_len);
  // The saved variable is gone; forget the handle. Must not fail.
  void (*release)(void* ctx, uint64_t handle);
  // Returns a new reference to the context (for a hooks object that outlives the scope).
  void* (*retain)(void* ctx);
  // Drops a reference obtained from `retain`.
  void (*drop)(void* ctx);
};

Callbacks g_callbacks{};
std::atomic<bool> g_installed{false};
thread_local void* t_ctx = nullptr;

// A recomputation stopping at the last tensor backward needs (pack's status 2). Thrown before the
// operation launches its kernel, caught by tch as any error; unlike c10::Error it captures no
// stack trace, which would cost more than the work it saves.
struct StopRecomputation final : std::exception {
  const char* what() const noexcept override { return "stagehand: the recomputation stopped early"; }
};

class StagehandHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit StagehandHooks(void* ctx) : ctx_(g_callbacks.retain(ctx)) {}

  ~StagehandHooks() override {
    if (packed_) g_callbacks.release(ctx_, handle_);
    g_callbacks.drop(ctx_);
  }

  void call_pack_hook(const at::Tensor& tensor) override {
    char err[kErrLen] = {0};
    int rc = g_callbacks.pack(ctx_, new at::Tensor(tensor), &handle_, err, kErrLen);
    if (rc == 2) throw StopRecomputation();
    TORCH_CHECK(rc == 0, "stagehand pack hook failed: ", err);
    packed_ = true;
  }

  at::Tensor call_unpack_hook() override {
    TORCH_CHECK(packed_, "stagehand unpack hook called before pack");
    char err[kErrLen] = {0};
    at::Tensor* out = nullptr;
    int rc = g_callbacks.unpack(ctx_, handle_, &out, err, kErrLen);
    TORCH_CHECK(rc == 0 && out != nullptr, "stagehand unpack hook failed: ", err);
    at::Tensor result = std::move(*out);
    delete out;
    return result;
  }

 private:
  void* ctx_;
  uint64_t handle_ = 0;
  bool packed_ = false;
};

class StagehandEngine final : public torch::autograd::Engine {
 public:
  static StagehandEngine& instance() {
    static StagehandEngine engine;
    return engine;
  }

  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (t_ctx != nullptr) return std::make_unique<StagehandHooks>(t_ctx);
    return Engine::get_default_saved_variable_hooks();
  }

 private:
  StagehandEngine() = default;
};

torch::autograd::Engine& engine_stub() { return StagehandEngine::instance(); }

// libtorch starts the autograd engine's device threads once per process, for whichever engine
// runs the first backward. Installing our engine while the binary loads, before main, means no
// backward can ever run on the stock engine first. It behaves exactly like the stock engine
// until a thread sets a hook context.
struct InstallAtLoad {
  InstallAtLoad() { torch::autograd::set_default_engine_stub(&engine_stub); }
};
InstallAtLoad g_install_at_load;

void write_err(char* err, size_t len, const char* msg) {
  if (err == nullptr || len == 0) return;
  std::strncpy(err, msg, len - 1);
  err[len - 1] = '\0';
}

}  // namespace

extern "C" {

// Installs the engine and the callbacks. Idempotent; must run before the first backward.
int stagehand_hooks_install(
    int (*pack)(void*, at::Tensor*, uint64_t*, char*, size_t),
    int (*unpack)(void*, uint64_t, at::Tensor**, char*, size_t),
    void (*release)(void*, uint64_t),
    void* (*retain)(void*),
    void (*drop)(void*),
    char* err,
    size_t err_len) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (g_installed.load()) return 0;
  try {
    g_callbacks = Callbacks{pack, unpack, release, retain, drop};
    torch::autograd::set_default_engine_stub(&engine_stub);
    g_installed.store(true);
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 1;
  }
}

// Whether the hook engine is the default engine.
int stagehand_hooks_installed() { return g_installed.load() ? 1 : 0; }

// This thread's hook context (null: hooks off).
void* stagehand_hooks_get_context() { return t_ctx; }

// Sets this thread's hook context (null: hooks off) and returns the previous one.
void* stagehand_hooks_set_context(void* ctx) {
  void* prev = t_ctx;
  t_ctx = ctx;
  return prev;
}

// A zero-dimensional unsigned 64-bit tensor on the CPU, holding 0: a kind tch cannot name, as
// flash attention's saved RNG seed and offset are on CUDA (for the hooks' tests).
at::Tensor* stagehand_unsigned_scalar() { return new at::Tensor(at::zeros({}, at::dtype(at::kUInt64))); }

// Storage identity of a tensor, for dedupe and weight recognition.
void stagehand_tensor_identity(const at::Tensor* t, uint64_t* storage_ptr, int64_t* storage_offset,
                               uint64_t* storage_nbytes) {
  if (!t->defined() || !t->has_storage()) {
    *storage_ptr = 0;
    *storage_offset = 0;
    *storage_nbytes = 0;
    return;
  }
  *storage_ptr = reinterpret_cast<uint64_t>(t->storage().data());
  *storage_offset = t->storage_offset();
  *storage_nbytes = t->storage().nbytes();
}

// A weak reference to a tensor's storage: tells later whether that very storage is still
// alive (a storage address alone may be reused by another tensor once the first is freed).
void* stagehand_storage_watch(const at::Tensor* t) {
  if (!t->defined() || !t->has_storage()) return nullptr;
  return new c10::weak_intrusive_ptr<c10::StorageImpl>(t->storage().getWeakStorageImpl());
}

int stagehand_storage_alive(const void* w) {
  if (w == nullptr) return 0;
  return static_cast<const c10::weak_intrusive_ptr<c10::StorageImpl>*>(w)->expired() ? 0 : 1;
}

void stagehand_storage_watch_free(void* w) {
  delete static_cast<c10::weak_intrusive_ptr<c10::StorageImpl>*>(w);
}

// ---- optimizer support -------------------------------------------------------------------
//
// The host optimizer steps streamed parameters whose gradients live in pinned host buffers it
// owns: it points each parameter's `.grad` at its buffer (or clears it when the parameter got
// no gradient, exactly like `zero_grad(set_to_none)` before an unused parameter) and runs
// libtorch's own optimizers, or its fused multi-tensor kernels, over them.

int stagehand_set_grad(at::Tensor* t, const at::Tensor* grad, char* err, size_t err_len) {
  try {
    t->mutable_grad() = grad == nullptr ? at::Tensor() : *grad;
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 1;
  }
}

static std::vector<at::Tensor> list(at::Tensor** ts, size_t n) {
  std::vector<at::Tensor> v;
  v.reserve(n);
  for (size_t i = 0; i < n; ++i) v.push_back(*ts[i]);
  return v;
}

// kind: 0 Adam, 1 AdamW. `steps` are float32 scalar tensors, advanced by one here.
int stagehand_fused_adam(int kind, at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs,
                         at::Tensor** exp_avg_sqs, at::Tensor** steps, size_t n, double lr, double beta1,
                         double beta2, double weight_decay, double eps, int amsgrad, char* err,
                         size_t err_len) {
  try {
    auto p = list(params, n), g = list(grads, n), m = list(exp_avgs, n), v = list(exp_avg_sqs, n),
         s = list(steps, n);
    std::vector<at::Tensor> max_sq;
    if (amsgrad) {
      TORCH_CHECK(false, "amsgrad is not supported by the fused host optimizer");
    }
    // The kernels read the step count; callers advance it (as torch.optim does).
    for (auto& t : s) t.add_(1);
    if (kind == 1) {
      at::_fused_adamw_(p, g, m, v, max_sq, s, lr, beta1, beta2, weight_decay, eps, false, false);
    } else {
      at::_fused_adam_(p, g, m, v, max_sq, s, lr, beta1, beta2, weight_decay, eps, false, false);
    }
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 1;
  }
}

// A variable's identity: its TensorImpl, shared by every handle (shallow clone) of it and kept
// when its data is replaced (`set_data`). libtorch's optimizers key their state by it.
const void* stagehand_tensor_impl(const at::Tensor* t) {
  return t->defined() ? static_cast<const void*>(t->unsafeGetTensorImpl()) : nullptr;
}

// Handles of a variable alive now (every shallow clone, every view's base), less the one its
// gradient accumulator holds while an autograd graph that uses it is alive: who else keeps it.
int64_t stagehand_tensor_handles(const at::Tensor* t) {
  if (!t->defined()) return 0;
  int64_t n = static_cast<int64_t>(t->use_count());
  if (t->requires_grad() && torch::autograd::impl::try_get_grad_accumulator(*t)) n -= 1;
  return n;
}

// ---- libtorch optimizers -----------------------------------------------------------------
//
// Made exactly as tch's `ato_adam` & co. make them (same classes, same options, parameters
// added to groups the same way), so a step is bit-identical with tch's optimizer.

struct StagehandOptimConfig {
  int algorithm;  // 0 SGD, 1 Adam, 2 AdamW, 3 RMSprop
  double lr;
  double momentum;
  double dampening;
  double weight_decay;
  double beta1;
  double beta2;
  double eps;
  double alpha;
  int nesterov;
  int amsgrad;
  int centered;
};

void* stagehand_optim_new(const StagehandOptimConfig* c, char* err, size_t err_len) {
  try {
    std::vector<at::Tensor> none;
    switch (c->algorithm) {
      case 0:
        return new torch::optim::SGD(none, torch::optim::SGDOptions(c->lr)
                                               .momentum(c->momentum)
                                               .dampening(c->dampening)
                                               .weight_decay(c->weight_decay)
                                               .nesterov(c->nesterov != 0));
      case 1:
        return new torch::optim::Adam(none, torch::optim::AdamOptions(c->lr)
                                                .betas(std::tuple<double, double>(c->beta1, c->beta2))
                                                .weight_decay(c->weight_decay)
                                                .eps(c->eps)
                                                .amsgrad(c->amsgrad != 0));
      case 2:
        return new torch::optim::AdamW(none, torch::optim::AdamWOptions(c->lr)
                                                 .betas(std::tuple<double, double>(c->beta1, c->beta2))
                                                 .weight_decay(c->weight_decay)
                                                 .eps(c->eps)
                                                 .amsgrad(c->amsgrad != 0));
      case 3:
        return new torch::optim::RMSprop(none, torch::optim::RMSpropOptions(c->lr)
                                                   .alpha(c->alpha)
                                                   .eps(c->eps)
                                                   .weight_decay(c->weight_decay)
                                                   .momentum(c->momentum)
                                                   .centered(c->centered != 0));
      default:
        write_err(err, err_len, "unknown optimizer algorithm");
        return nullptr;
    }
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return nullptr;
  }
}

void stagehand_optim_free(void* o) { delete static_cast<torch::optim::Optimizer*>(o); }

// Adds `t` to parameter group `group`, making the groups up to it from the defaults (as tch).
int stagehand_optim_add(void* o, const at::Tensor* t, size_t group, char* err, size_t err_len) {
  try {
    auto* opt = static_cast<torch::optim::Optimizer*>(o);
    auto& groups = opt->param_groups();
    while (groups.size() <= group) {
      groups.push_back(torch::optim::OptimizerParamGroup({}, opt->defaults().clone()));
    }
    groups[group].params().push_back(*t);
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 1;
  }
}

size_t stagehand_optim_groups(void* o) { return static_cast<torch::optim::Optimizer*>(o)->param_groups().size(); }

// Sets the learning rate, weight decay and momentum (Adam's beta1) of one group.
int stagehand_optim_set_group(void* o, size_t group, double lr, double weight_decay, double momentum,
                              char* err, size_t err_len) {
  try {
    auto* opt = static_cast<torch::optim::Optimizer*>(o);
    auto* d = &opt->param_groups().at(group).options();
    if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(d)) {
      a->lr(lr).weight_decay(weight_decay).betas(std::tuple<double, double>(momentum, std::get<1>(a->betas())));
    } else if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(d)) {
      w->lr(lr).weight_decay(weight_decay).betas(std::tuple<double, double>(momentum, std::get<1>(w->betas())));
    } else if (auto* r = dynamic_cast<torch::optim::RMSpropOptions*>(d)) {
      r->lr(lr).weight_decay(weight_decay).momentum(momentum);
    } else if (auto* s = dynamic_cast<torch::optim::SGDOptions*>(d)) {
      s->lr(lr).weight_decay(weight_decay).momentum(momentum);
    } else {
      TORCH_CHECK(false, "unexpected optimizer options");
    }
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 1;
  }
}

int stagehand_optim_step(void* o, char* err, size_t err_len) {
  try {
    static_cast<torch::optim::Optimizer*>(o)->step();
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 1;
  }
}

// libtorch's zero_grad(set_to_none = true), as tch's.
int stagehand_optim_zero_grad(void* o, char* err, size_t err_len) {
  try {
    static_cast<torch::optim::Optimizer*>(o)->zero_grad();
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 1;
  }
}

static bool holds(torch::optim::Optimizer* opt, const at::Tensor& p) {
  for (auto& g : opt->param_groups()) {
    for (auto& q : g.params()) {
      if (q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return true;
    }
  }
  return false;
}

static at::Tensor* out_tensor(const at::Tensor& t) { return t.defined() ? new at::Tensor(t) : nullptr; }

// The state of parameter `p`: `*present` is 0 when it has none yet (never stepped). Otherwise
// `*step` is its step count (Adam, AdamW, RMSprop) and `out` (3 slots) holds new handles to its
// state tensors, null where undefined, in this order:
//   Adam, AdamW: exp_avg, exp_avg_sq, max_exp_avg_sq;  SGD: momentum_buffer;
//   RMSprop: square_avg, momentum_buffer, grad_avg.
int stagehand_optim_state_get(void* o, const at::Tensor* p, int* present, int64_t* step, at::Tensor** out,
                              char* err, size_t err_len) {
  try {
    auto* opt = static_cast<torch::optim::Optimizer*>(o);
    out[0] = out[1] = out[2] = nullptr;
    *step = 0;
    auto& state = opt->state();
    auto it = state.find(p->unsafeGetTensorImpl());
    if (it == state.end()) {
      *present = 0;
      return 0;
    }
    *present = 1;
    auto* s = it->second.get();
    if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(s)) {
      *step = a->step();
      out[0] = out_tensor(a->exp_avg());
      out[1] = out_tensor(a->exp_avg_sq());
      out[2] = out_tensor(a->max_exp_avg_sq());
    } else if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(s)) {
      *step = w->step();
      out[0] = out_tensor(w->exp_avg());
      out[1] = out_tensor(w->exp_avg_sq());
      out[2] = out_tensor(w->max_exp_avg_sq());
    } else if (auto* g = dynamic_cast<torch::optim::SGDParamState*>(s)) {
      out[0] = out_tensor(g->momentum_buffer());
    } else if (auto* r = dynamic_cast<torch::optim::RMSpropParamState*>(s)) {
      *step = r->step();
      out[0] = out_tensor(r->square_avg());
      out[1] = out_tensor(r->momentum_buffer());
      out[2] = out_tensor(r->grad_avg());
    } else {
      TORCH_CHECK(false, "unexpected optimizer state");
    }
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 1;
  }
}

// Replaces the state of parameter `p` (which must be one of the optimizer's): `in` holds 3
// tensors in the order of stagehand_optim_state_get, null where absent. The tensors are used as
// they are (the caller makes them contiguous copies on the parameter's device).
int stagehand_optim_state_set(void* o, const at::Tensor* p, int64_t step, at::Tensor** in, char* err,
                              size_t err_len) {
  try {
    auto* opt = static_cast<torch::optim::Optimizer*>(o);
    TORCH_CHECK(holds(opt, *p), "the tensor is not a parameter of this optimizer");
    auto get = [&](int i) { return in[i] == nullptr ? at::Tensor() : *in[i]; };
    auto* d = &opt->defaults();
    std::unique_ptr<torch::optim::OptimizerParamState> st;
    if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(d)) {
      TORCH_CHECK(in[0] && in[1], "Adam state needs exp_avg and exp_avg_sq");
      TORCH_CHECK(!a->amsgrad() || in[2], "Adam with amsgrad needs max_exp_avg_sq");
      auto s = std::make_unique<torch::optim::AdamParamState>();
      s->step(step).exp_avg(get(0)).exp_avg_sq(get(1)).max_exp_avg_sq(get(2));
      st = std::move(s);
    } else if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(d)) {
      TORCH_CHECK(in[0] && in[1], "AdamW state needs exp_avg and exp_avg_sq");
      TORCH_CHECK(!w->amsgrad() || in[2], "AdamW with amsgrad needs max_exp_avg_sq");
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(step).exp_avg(get(0)).exp_avg_sq(get(1)).max_exp_avg_sq(get(2));
      st = std::move(s);
    } else if (auto* g = dynamic_cast<torch::optim::SGDOptions*>(d)) {
      TORCH_CHECK(g->momentum() == 0 || in[0], "SGD with momentum needs momentum_buffer");
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(get(0));
      st = std::move(s);
    } else if (auto* r = dynamic_cast<torch::optim::RMSpropOptions*>(d)) {
      TORCH_CHECK(in[0], "RMSprop state needs square_avg");
      TORCH_CHECK(r->momentum() <= 0 || in[1], "RMSprop with momentum needs momentum_buffer");
      TORCH_CHECK(!r->centered() || in[2], "centered RMSprop needs grad_avg");
      auto s = std::make_unique<torch::optim::RMSpropParamState>();
      s->step(step).square_avg(get(0)).momentum_buffer(get(1)).grad_avg(get(2));
      st = std::move(s);
    } else {
      TORCH_CHECK(false, "unexpected optimizer options");
    }
    opt->state()[p->unsafeGetTensorImpl()] = std::move(st);
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 1;
  }
}

// ---- device allocator statistics --------------------------------------------------------

struct StagehandAllocStats {
  int64_t allocated_current;
  int64_t allocated_peak;
  int64_t reserved_current;
  int64_t reserved_peak;
  int64_t active_current;
  int64_t active_peak;
  int64_t num_ooms;
  int64_t num_alloc_retries;
};

static c10::DeviceAllocator* cuda_allocator() {
  auto* a = c10::GetAllocator(c10::DeviceType::CUDA);
  if (a == nullptr) return nullptr;
  return dynamic_cast<c10::DeviceAllocator*>(a);
}

// 0 on success; 1 when no CUDA allocator is registered; 2 on a torch error (message in err).
int stagehand_cuda_alloc_stats(int device, StagehandAllocStats* out, char* err, size_t err_len) {
  try {
    auto* a = cuda_allocator();
    if (a == nullptr || !a->initialized()) return 1;
    auto s = a->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out->allocated_current = s.allocated_bytes[kAll].current;
    out->allocated_peak = s.allocated_bytes[kAll].peak;
    out->reserved_current = s.reserved_bytes[kAll].current;
    out->reserved_peak = s.reserved_bytes[kAll].peak;
    out->active_current = s.active_bytes[kAll].current;
    out->active_peak = s.active_bytes[kAll].peak;
    out->num_ooms = s.num_ooms;
    out->num_alloc_retries = s.num_alloc_retries;
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 2;
  }
}

int stagehand_cuda_reset_peak(int device, char* err, size_t err_len) {
  try {
    auto* a = cuda_allocator();
    if (a == nullptr || !a->initialized()) return 1;
    a->resetPeakStats(static_cast<c10::DeviceIndex>(device));
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 2;
  }
}

int stagehand_cuda_empty_cache(char* err, size_t err_len) {
  try {
    auto* a = cuda_allocator();
    if (a == nullptr || !a->initialized()) return 1;
    a->emptyCache();
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 2;
  }
}

int stagehand_cuda_mem_info(int device, uint64_t* free_bytes, uint64_t* total_bytes, char* err,
                            size_t err_len) {
  try {
    auto* a = cuda_allocator();
    if (a == nullptr || !a->initialized()) return 1;
    auto info = a->getMemoryInfo(static_cast<c10::DeviceIndex>(device));
    *free_bytes = info.first;
    *total_bytes = info.second;
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 2;
  }
}

// ---- mixed precision ------------------------------------------------------------------------

static c10::DeviceType autocast_device(int cuda) { return cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU; }

// This thread's autocast state for a device type (0 CPU, 1 CUDA): enabled, and the dtype as
// libtorch's ScalarType code.
void stagehand_autocast_get(int cuda, int* enabled, int* dtype) {
  auto d = autocast_device(cuda);
  *enabled = at::autocast::is_autocast_enabled(d) ? 1 : 0;
  *dtype = static_cast<int>(at::autocast::get_autocast_dtype(d));
}

// Sets this thread's autocast state for a device type and enters (or, `enter` 0, leaves) one
// level of nesting; leaving the outermost level clears the cache of casts made inside it.
int stagehand_autocast_set(int cuda, int enabled, int dtype, int enter, char* err, size_t err_len) {
  try {
    auto d = autocast_device(cuda);
    at::autocast::set_autocast_dtype(d, static_cast<at::ScalarType>(dtype));
    at::autocast::set_autocast_enabled(d, enabled != 0);
    if (enter) {
      at::autocast::increment_nesting();
    } else if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 1;
  }
}

// ---- attention ---------------------------------------------------------------------------

// One of libtorch's fused attention kernels (0 flash, 1 cuDNN; CUDA, 16-bit (batch, heads,
// time, head dim) inputs), called as itself rather than through scaled_dot_product_attention's
// dispatcher, which may choose a different backend for the same call on another thread; tch
// binds neither. Autograd records it as the dispatcher would. Null with a message when libtorch
// refuses the inputs.
at::Tensor* stagehand_fused_attention(int kernel, const at::Tensor* q, const at::Tensor* k, const at::Tensor* v,
                                      int causal, char* err, size_t err_len) {
  try {
    if (kernel == 0) {
      auto out = at::_scaled_dot_product_flash_attention(*q, *k, *v, 0.0, causal != 0, false, std::nullopt);
      return new at::Tensor(std::get<0>(out));
    }
    if (kernel == 1) {
      auto out = at::_scaled_dot_product_cudnn_attention(*q, *k, *v, std::nullopt, true, 0.0, causal != 0, false,
                                                         std::nullopt);
      return new at::Tensor(std::get<0>(out));
    }
    write_err(err, err_len, "unknown attention kernel");
    return nullptr;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return nullptr;
  }
}

// TF32 for float32 matmuls (cuBLAS) and convolutions (cuDNN), process-wide, as
// torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32.
void stagehand_set_tf32(int on) {
  at::globalContext().setFloat32MatmulPrecision(on ? "high" : "highest");
  at::globalContext().setAllowTF32CuDNN(on != 0);
}

int stagehand_tf32() { return at::globalContext().allowTF32CuBLAS() ? 1 : 0; }

// libgomp's (libtorch's OpenMP runtime): sets the calling thread's team size for its parallel
// regions, and no other thread's.
void omp_set_num_threads(int n);

// The default CPU generator's state (the random numbers tch's initialisers and `randn` draw
// next): its size in bytes, copied into `out` when `cap` holds it; 0 when it cannot be read.
size_t stagehand_cpu_rng_state(uint8_t* out, size_t cap) {
  try {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    at::Tensor state = gen.get_state();
    size_t n = state.nbytes();
    if (out != nullptr && n <= cap) {
      std::memcpy(out, state.data_ptr(), n);
    }
    return n;
  } catch (...) {
    return 0;
  }
}

// Puts the default CPU generator back to a state read by stagehand_cpu_rng_state.
int stagehand_cpu_rng_set_state(const uint8_t* in, size_t len, char* err, size_t err_len) {
  try {
    at::Tensor state = at::empty({static_cast<int64_t>(len)}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(state.data_ptr(), in, len);
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
    return 0;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return 1;
  }
}

void stagehand_set_local_intra_op_threads(int n) {
  // at::set_num_threads would also change the process-wide count that every thread adopts at
  // its first parallel op. This thread's own first-op initialisation runs here first, so that
  // it cannot later overwrite the count set below.
  (void)at::get_num_threads();
  omp_set_num_threads(n);
}

}  // extern "C"
