// A private data member of an MLX class, where MLX keeps private what an op needs (an array's
// holder count, a CUDA encoder's commit limits). An explicit instantiation may name a private
// member (access is not checked there, [temp.spec.general]), so PrivateMember<Tag, &C::m_>
// instantiated once hands the member pointer out through the Tag's friend function:
//   struct Tag { friend constexpr auto private_member(Tag); };
//   template struct PrivateMember<Tag, &C::m_>;
//   object.*private_member(Tag{})
#pragma once

namespace attn_kernels {

template <typename Tag, auto Member>
struct PrivateMember {
  friend constexpr auto private_member(Tag) { return Member; }
};

}  // namespace attn_kernels
