// DTRAIN_ARG: a builder-style option with a default, as TORCH_ARG in the PyTorch C++ frontend:
//   struct FooOptions { DTRAIN_ARG(int, size, 4); };   FooOptions().size(8).size() == 8
#pragma once

#include <utility>

#define DTRAIN_ARG(T, name, init)                          \
 public:                                                   \
  auto name(T new_##name)->decltype(*this) {               \
    this->name##_ = std::move(new_##name);                 \
    return *this;                                          \
  }                                                        \
  const T& name() const noexcept { return this->name##_; } \
                                                           \
 private:                                                  \
  T name##_ = init;                                        \
                                                           \
 public:
