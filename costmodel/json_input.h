// Checked reading of user JSON: every field is looked up through Fields, which knows the
// path of the object ("model", "cluster.links.inter_node"), enforces type and range, and
// rejects unknown keys. Failures throw InputError with a message naming the field, the
// value and the rule; the CLI turns it into exit code 2. No other module parses JSON.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

// Only the declaration of nlohmann::json: most files that include this header (through
// hardware.h) never touch a JSON value, and the full header took ~1.6 s of each one's
// compile. Files that read or build JSON include <nlohmann/json.hpp> themselves.
#include <nlohmann/json_fwd.hpp>

namespace strata {

using Json = nlohmann::json;

// Bad user input. The message names the field, the value and the rule it breaks.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Parses text as JSON; a syntax error names the source and the byte offset.
Json parse_json_text(const std::string& text, const std::string& source);
// A file's bytes; a missing or unreadable file, or one over max_bytes ("the limit for
// `kind`"), is an InputError naming `what`.
std::string read_text_file(const std::string& path, const std::string& what, int64_t max_bytes, const char* kind);
// Reads and parses a file (at most 64 MiB); a missing or unreadable file is an InputError.
Json read_json_file(const std::string& path, const std::string& what);
// Short rendering of a JSON value for messages (strings quoted, long values cut).
std::string show_value(const Json& v);

class Fields {
 public:
  Fields(const Json& object, std::string path);

  bool has(const std::string& key) const;
  // The raw value, or null when absent (does not mark the key as read).
  const Json* peek(const std::string& key) const;
  // Integers: JSON numbers with no fractional part, within [lo, hi].
  int64_t integer(const std::string& key, int64_t lo, int64_t hi);
  int64_t integer_or(const std::string& key, int64_t fallback, int64_t lo, int64_t hi);
  // Reals: finite numbers within [lo, hi].
  double real(const std::string& key, double lo, double hi);
  double real_or(const std::string& key, double fallback, double lo, double hi);
  bool boolean_or(const std::string& key, bool fallback);
  std::string string(const std::string& key);
  std::string string_or(const std::string& key, const std::string& fallback);
  // A string that must be one of `allowed`.
  std::string choice_or(const std::string& key, const std::string& fallback,
                        std::initializer_list<const char*> allowed);
  const Json& object(const std::string& key);
  const Json& array(const std::string& key);
  // Marks a key as known without reading it (documentation fields, "_source", ...).
  void ignore(const std::string& key);
  // Throws if the object holds a key nobody read.
  void reject_unknown() const;
  // Throws if the object holds a key not in `known` (checked before any value is read).
  void reject_unknown_except(std::initializer_list<const char*> known) const;
  std::string path_of(const std::string& key) const;

 private:
  const Json& get(const std::string& key, const char* expected_type);
  [[noreturn]] void unknown(const std::string& key) const;
  const Json& obj_;
  std::string path_;
  std::set<std::string> seen_;
};

// Another tool's name for a field of this schema (a Megatron-LM argument, a DeepSpeed
// config key): moves j[from] (j an object) to j[to], as `convert` makes it (it gets the
// value and its path; none: the value as it is). A null value or result means the key
// states nothing (null in a config dump, a flag set to false) and is dropped. Both names
// present with two values: an InputError naming both.
using ConvertValue = Json (*)(const Json& value, const std::string& path);
void adopt_key(Json& j, const std::string& source, const char* from, const char* to, ConvertValue convert = nullptr);
// A Megatron flag's value: true or false (or 0/1) and nothing else.
bool flag_value(const Json& v, const std::string& path);

// Error helper: "<field>: <value> is invalid: <rule>".
[[noreturn]] void fail_field(const std::string& field, const std::string& value, const std::string& rule);

}  // namespace strata
