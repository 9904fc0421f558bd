// Exhaustive visitors. A visitor over a variant written as an `if constexpr` chain ends with
//   else static_assert(rlloop::detail::unhandled_alternative<T>, "...");
// so a variant that gains an alternative stops compiling at every visitor that does not handle it, instead of
// running the new alternative through a catch-all branch meant for another one.
#pragma once

namespace rlloop::detail {

template <class T>
inline constexpr bool unhandled_alternative = false;

}  // namespace rlloop::detail
