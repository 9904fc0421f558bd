// Umbrella header of the header-only core. No LibTorch and no wire protocol (the compiled rlloop::wire module).
#pragma once
#include <rlloop/batch_checks.hpp>
#include <rlloop/clients.hpp>
#include <rlloop/error.hpp>
#include <rlloop/future.hpp>
#include <rlloop/limits.hpp>
#include <rlloop/loss.hpp>
#include <rlloop/session.hpp>
#include <rlloop/tokenizer.hpp>
#include <rlloop/types.hpp>
