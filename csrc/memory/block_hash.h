// Content hashes of full token blocks, chained so a block's hash covers its whole prefix.
//
// hash(block i) = XXH64(seed 0, bytes = le64(parent) || le64(token) for each of its tokens)
// where parent is the previous block's hash, or the caller's parent (0 when none) for the
// first. Two sequences share the hash of block i exactly when they share tokens 0..i.
//
// Why XXH64: a 64-bit non-cryptographic hash with full avalanche (it passes SMHasher), about
// 10 GB/s, a published spec with reference vectors, and the hash nano-vllm uses for the same
// job. A prefix collision needs two of the cached blocks to collide; with a million cached
// blocks that chance is about 3e-8. Cryptographic hashes (vLLM's optional sha256) defend
// against adversarial prompts at roughly 10x the cost; kvmove's block ids are local to one
// engine, so we take the fast hash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "common/hash.h"

namespace kvmove {

// One hash per full block of tokens; a trailing partial block gets none.
// seed: XXH64's seed for every block. 0 (the default) gives the plain chain; a secret seed
// (derived from the deployment key) gives hashes nobody without it can predict, so nobody can
// engineer two prompts whose blocks collide in a shared prefix cache or store (vLLM's
// CVE-2025-25183 class of attack: an unkeyed hash served one tenant's KV to another).
std::vector<uint64_t> block_hashes(const int64_t* tokens, size_t num_tokens, int64_t block_size,
                                   std::optional<uint64_t> parent, uint64_t seed = 0);

}  // namespace kvmove
