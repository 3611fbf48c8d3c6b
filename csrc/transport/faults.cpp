#include "transport/faults.h"

#include <cmath>
#include <sstream>

#include "common/errors.h"

namespace kvmove {

namespace {

double parse_number(const std::string& key, const std::string& value, double max) {
    size_t used = 0;
    double v = 0;
    try {
        v = std::stod(value, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    KVMOVE_CHECK(
        used == value.size() && !value.empty() && std::isfinite(v) && v >= 0 && v <= max, Config,
        "fault '" << key << "' needs a number in [0, " << max << "], got '" << value << "'");
    return v;
}

}  // namespace

bool FaultConfig::any() const {
    return fail_post_every > 0 || delay_post_us > 0 || drop_message > 0 || delay_message_ms > 0 ||
           corrupt_every > 0 || rndv_messages;
}

FaultConfig parse_faults(const std::string& spec) {
    FaultConfig config;
    std::istringstream entries(spec);
    std::string entry;
    while (std::getline(entries, entry, ',')) {
        if (entry.empty()) {
            continue;
        }
        const size_t eq = entry.find('=');
        KVMOVE_CHECK(eq != std::string::npos, Config,
                     "fault '" << entry << "' must be key=value (seed, fail_post, "
                               << "delay_post_us, drop_message, delay_message_ms, corrupt_every, "
                               << "rndv_messages)");
        const std::string key = entry.substr(0, eq), value = entry.substr(eq + 1);
        if (key == "seed") {
            config.seed = static_cast<uint64_t>(parse_number(key, value, 1e18));
        } else if (key == "fail_post") {
            config.fail_post_every = static_cast<uint64_t>(parse_number(key, value, 1e12));
        } else if (key == "delay_post_us") {
            config.delay_post_us = parse_number(key, value, 1e7);
        } else if (key == "drop_message") {
            config.drop_message = parse_number(key, value, 1);
        } else if (key == "delay_message_ms") {
            config.delay_message_ms = parse_number(key, value, 1e5);
        } else if (key == "corrupt_every") {
            config.corrupt_every = static_cast<uint64_t>(parse_number(key, value, 1e12));
        } else if (key == "rndv_messages") {
            config.rndv_messages = parse_number(key, value, 1) == 1;
        } else {
            KVMOVE_FAIL(Config, "unknown fault '" << key << "': known are seed, fail_post, "
                                                  << "delay_post_us, drop_message, "
                                                  << "delay_message_ms, corrupt_every, "
                                                  << "rndv_messages");
        }
    }
    return config;
}

FaultInjector::FaultInjector(FaultConfig config) : config_(config), random_(config.seed) {}

bool FaultInjector::chance(double p) {
    return p > 0 && std::uniform_real_distribution<double>(0, 1)(random_) < p;
}

bool FaultInjector::fail_post() {
    std::lock_guard<std::mutex> lock(mu_);
    ++posts_;
    if (config_.fail_post_every > 0 && posts_ % config_.fail_post_every == 0) {
        ++counts_["fail_post"];
        return true;
    }
    return false;
}

double FaultInjector::post_delay_seconds() {
    if (config_.delay_post_us <= 0) {
        return 0;
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_["delay_post"];
    return config_.delay_post_us * 1e-6;
}

bool FaultInjector::drop_message() {
    std::lock_guard<std::mutex> lock(mu_);
    if (chance(config_.drop_message)) {
        ++counts_["drop_message"];
        return true;
    }
    return false;
}

double FaultInjector::message_delay_seconds() {
    if (config_.delay_message_ms <= 0) {
        return 0;
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_["delay_message"];
    return config_.delay_message_ms * 1e-3;
}

bool FaultInjector::corrupt_layer() {
    std::lock_guard<std::mutex> lock(mu_);
    ++layers_;
    if (config_.corrupt_every > 0 && layers_ % config_.corrupt_every == 0) {
        ++counts_["corrupt"];
        return true;
    }
    return false;
}

bool FaultInjector::rndv_message() {
    if (!config_.rndv_messages) {
        return false;
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_["rndv_message"];
    return true;
}

std::map<std::string, uint64_t> FaultInjector::counts() const {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_;
}

}  // namespace kvmove
