#include "memory/free_runs.h"

namespace kvmove {

namespace {

constexpr uint64_t kOne = 1;

inline int lowest_bit(uint64_t x) {
    return __builtin_ctzll(x);
}
inline int highest_bit(uint64_t x) {
    return 63 - __builtin_clzll(x);
}

}  // namespace

FreeRuns::FreeRuns(int64_t num_ids)
    : len_at_start_(num_ids, 0),
      start_at_end_(num_ids, -1),
      next_(num_ids, -1),
      prev_(num_ids, -1),
      head_(num_ids + 1, -1),
      len_bits_((num_ids + 64) / 64, 0),
      word_bits_((len_bits_.size() + 63) / 64, 0) {
    insert(0, num_ids);
}

void FreeRuns::insert(int64_t start, int64_t num) {
    num_free_ += num;
    auto s = static_cast<int32_t>(start);
    auto end = static_cast<int32_t>(start + num);  // one past the last id
    auto n = static_cast<int32_t>(num);
    if (end < static_cast<int32_t>(len_at_start_.size()) && len_at_start_[end] > 0) {
        n += len_at_start_[end];
        unlink(end);
    }
    if (s > 0 && start_at_end_[s - 1] >= 0) {
        int32_t left = start_at_end_[s - 1];
        n += len_at_start_[left];
        unlink(left);
        s = left;
    }
    link(s, n);
}

void FreeRuns::take(int64_t n, std::vector<int64_t>& out) {
    num_free_ -= n;
    auto remaining = static_cast<int32_t>(n);
    while (remaining > 0) {
        int32_t fit = shortest_at_least(remaining);
        int32_t len = fit > 0 ? fit : longest();
        int32_t start = head_[len];
        int32_t used = len < remaining ? len : remaining;
        unlink(start);
        if (used < len) {
            link(start + used, len - used);
        }
        for (int32_t id = start; id < start + used; ++id) {
            out.push_back(id);
        }
        remaining -= used;
    }
}

void FreeRuns::link(int32_t start, int32_t num) {
    len_at_start_[start] = num;
    start_at_end_[start + num - 1] = start;
    prev_[start] = -1;
    next_[start] = head_[num];
    if (head_[num] >= 0) {
        prev_[head_[num]] = start;
    } else {
        set_len_bit(num);
    }
    head_[num] = start;
}

void FreeRuns::unlink(int32_t start) {
    int32_t num = len_at_start_[start];
    len_at_start_[start] = 0;
    start_at_end_[start + num - 1] = -1;
    if (prev_[start] >= 0) {
        next_[prev_[start]] = next_[start];
    } else {
        head_[num] = next_[start];
    }
    if (next_[start] >= 0) {
        prev_[next_[start]] = prev_[start];
    }
    if (head_[num] < 0) {
        clear_len_bit(num);
    }
}

void FreeRuns::set_len_bit(int32_t num) {
    len_bits_[num / 64] |= kOne << (num % 64);
    word_bits_[num / 4096] |= kOne << ((num / 64) % 64);
}

void FreeRuns::clear_len_bit(int32_t num) {
    len_bits_[num / 64] &= ~(kOne << (num % 64));
    if (len_bits_[num / 64] == 0) {
        word_bits_[num / 4096] &= ~(kOne << ((num / 64) % 64));
    }
}

int32_t FreeRuns::shortest_at_least(int32_t num) const {
    size_t word = num / 64;
    if (word >= len_bits_.size()) {
        return 0;
    }
    uint64_t bits = len_bits_[word] & (~uint64_t{0} << (num % 64));
    if (bits != 0) {
        return static_cast<int32_t>(word * 64 + lowest_bit(bits));
    }
    // The next non-empty word after `word`, through the summary.
    size_t next = word + 1;
    for (size_t s = next / 64; s < word_bits_.size(); ++s) {
        uint64_t words =
            word_bits_[s] & (s == next / 64 ? ~uint64_t{0} << (next % 64) : ~uint64_t{0});
        if (words != 0) {
            size_t w = s * 64 + lowest_bit(words);
            return static_cast<int32_t>(w * 64 + lowest_bit(len_bits_[w]));
        }
    }
    return 0;
}

int32_t FreeRuns::longest() const {
    for (size_t s = word_bits_.size(); s-- > 0;) {
        if (word_bits_[s] != 0) {
            size_t w = s * 64 + highest_bit(word_bits_[s]);
            return static_cast<int32_t>(w * 64 + highest_bit(len_bits_[w]));
        }
    }
    return 0;
}

}  // namespace kvmove
