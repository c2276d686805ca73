// How a custom autograd node is owned, for every torch release we build against:
// torch 2.14 holds nodes in c10::intrusive_ptr, earlier releases (2.11)
// in std::shared_ptr with torch's own deleter. The owner type is
// read off Node::getptr(), so no version number is spelled here.
#pragma once

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace torch_bn_grad {
namespace node_detail {

template <class Pointer, class Derived>
struct Owner;

template <class Base, class Derived>
struct Owner<std::shared_ptr<Base>, Derived> {
  using type = std::shared_ptr<Derived>;
  // torch's deleteNode frees deep graphs without recursing, as its generated
  // nodes do. Called with a Base* (dependent), so that it is looked up only
  // where this specialization is used: torch 2.14 has no deleteNode.
  static type make() {
    return type(new Derived(), [](Base* node) { deleteNode(node); });
  }
};

template <class Base, class Derived>
struct Owner<c10::intrusive_ptr<Base>, Derived> {
  using type = c10::intrusive_ptr<Derived>;
  static type make() { return c10::make_intrusive<Derived>(); }
};

template <class Derived>
using OwnerOf = Owner<decltype(std::declval<torch::autograd::Node&>().getptr()), Derived>;

}  // namespace node_detail

// The pointer that owns a node of type Derived (a torch::autograd::Node).
template <class Derived>
using NodePtr = typename node_detail::OwnerOf<Derived>::type;

// A new, default-constructed node of type Derived.
template <class Derived>
NodePtr<Derived> make_node() {
  static_assert(std::is_base_of_v<torch::autograd::Node, Derived>);
  return node_detail::OwnerOf<Derived>::make();
}

}  // namespace torch_bn_grad
