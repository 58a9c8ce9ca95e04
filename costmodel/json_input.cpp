// Checked JSON reading; see json_input.h.
#include "costmodel/json_input.h"

#include <algorithm>
#include <vector>
#include <cctype>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace strata {

void fail_field(const std::string& field, const std::string& value, const std::string& rule) {
  // DeepSpeed configs written for the Hugging Face Trainer hold "auto" where the Trainer
  // fills in its own arguments; strata has no Trainer to ask.
  const char* placeholder =
      value == "\"auto\"" || value == "'auto'"
          ? " (\"auto\" stands for a value another tool fills in, as the Hugging Face Trainer does in a DeepSpeed "
            "config: write the value itself)"
          : "";
  throw InputError(fmt::format("{}: {} is invalid: {}{}", field, value, rule, placeholder));
}

namespace {

// The SAX handler of parse_json_text's duplicate-key pass: a stack of the objects and
// arrays being read, with where each sits (for the message) and an object's keys so far.
class UniqueKeys : public nlohmann::json_sax<Json> {
 public:
  explicit UniqueKeys(const std::string& source) : source_(source) {}
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return open(true); }
  bool start_array(std::size_t) override { return open(false); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }
  bool key(string_t& k) override {
    last_key_ = k;
    if (!open_.back().keys.insert(k).second)
      throw InputError(fmt::format("{}: key \"{}\" is given twice in {}: keys of a JSON object must be unique", source_, k,
                                   open_.back().where.empty() ? "the top-level object" : "\"" + open_.back().where + "\""));
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

 private:
  struct Open {
    std::string where;
    bool object;
    std::set<std::string> keys;
  };
  bool open(bool object) {
    std::string where;
    if (!open_.empty())
      where = open_.back().object ? (open_.back().where.empty() ? "" : open_.back().where + ".") + last_key_
                                  : open_.back().where + "[]";
    open_.push_back({std::move(where), object, {}});
    return true;
  }
  bool close() {
    open_.pop_back();
    return true;
  }
  const std::string& source_;
  std::vector<Open> open_;
  std::string last_key_;
};

}  // namespace

Json parse_json_text(const std::string& text, const std::string& source) {
  // The parser recurses per nesting level: refuse absurd depth before it starts.
  constexpr int kMaxDepth = 256;
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (ch == '\\') escaped = true;
      else if (ch == '"') in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      if (++depth > kMaxDepth)
        throw InputError(fmt::format("{}: JSON nested deeper than {} levels at byte {}", source, kMaxDepth, i));
    } else if (ch == ']' || ch == '}') {
      --depth;
    }
  }
  // Keys given twice in one object: the parser keeps the last and drops the first without
  // a word, so a plan {"tp": 8, "tp": 4} would run tp=4. Refused, naming the object, by a
  // SAX pass first (linear; nlohmann's callback parser rescans an array at every object
  // it closes, quadratic in the objects of a large input).
  try {
    UniqueKeys unique(source);
    (void)Json::sax_parse(text, &unique);  // stops at a syntax error, which the parse reports
    return Json::parse(text);
  } catch (const Json::parse_error& e) {
    throw InputError(fmt::format("{}: malformed JSON at byte {}: {}", source, e.byte, e.what()));
  } catch (const Json::exception& e) {  // a number too large for any type (found by fuzzing), ...
    throw InputError(fmt::format("{}: invalid JSON: {}", source, e.what()));
  }
}

std::string read_text_file(const std::string& path, const std::string& what, int64_t max_bytes, const char* kind) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("{}: cannot open file '{}'", what, path));
  in.seekg(0, std::ios::end);
  const auto size = static_cast<int64_t>(in.tellg());
  if (size < 0) throw InputError(fmt::format("{}: cannot read file '{}'", what, path));
  if (size > max_bytes)
    throw InputError(fmt::format("{}: file '{}' has {} bytes; the limit for {} is {}", what, path, size, kind,
                                 max_bytes));
  in.seekg(0);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Json read_json_file(const std::string& path, const std::string& what) {
  return parse_json_text(read_text_file(path, what, 64ll << 20, "a JSON input"), fmt::format("{} '{}'", what, path));
}

std::string show_value(const Json& v) {
  // Strings that are not UTF-8 (from inline pairs, say) are shown with U+FFFD, never thrown on.
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

Fields::Fields(const Json& object, std::string path) : obj_(object), path_(std::move(path)) {
  if (!obj_.is_object())
    throw InputError(fmt::format("{}: {} is invalid: must be a JSON object", path_, show_value(obj_)));
}

std::string Fields::path_of(const std::string& key) const { return path_ + "." + key; }

const Json* Fields::peek(const std::string& key) const {
  return obj_.contains(key) ? &obj_.at(key) : nullptr;
}

bool Fields::has(const std::string& key) const { return obj_.contains(key) && !obj_.at(key).is_null(); }

namespace {
// Levenshtein distance of two short keys (for "did you mean").
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}
}  // namespace

const Json& Fields::get(const std::string& key, const char* expected_type) {
  seen_.insert(key);
  if (!obj_.contains(key)) {
    // A key of the object within two edits of the missing one is named (a misspelling).
    std::string near;
    // (Keys of 6 letters or more: short ones, fp16 beside fp32, are too alike to guess.)
    for (auto it = obj_.begin(); it != obj_.end() && near.empty(); ++it)
      if (it.key() != key && key.size() >= 6 && it.key().size() >= 6 && edit_distance(it.key(), key) <= 2)
        near = it.key();
    throw InputError(fmt::format("{}: missing: {} {} is required{}", path_of(key),
                                 std::strchr("aeiou", expected_type[0]) ? "an" : "a", expected_type,
                                 near.empty() ? "" : fmt::format(" (the object has '{}': a misspelling?)", near)));
  }
  return obj_.at(key);
}

void Fields::ignore(const std::string& key) { seen_.insert(key); }

int64_t Fields::integer(const std::string& key, int64_t lo, int64_t hi) {
  const Json& v = get(key, "integer");
  const std::string rule = fmt::format("must be an integer in [{}, {}]", lo, hi);
  if (v.is_number_integer() || v.is_number_unsigned()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi))
      fail_field(path_of(key), show_value(v), rule);
    const int64_t x = v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>()) : v.get<int64_t>();
    if (x < lo || x > hi) fail_field(path_of(key), show_value(v), rule);
    return x;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && d >= static_cast<double>(lo) && d <= static_cast<double>(hi))
      return static_cast<int64_t>(d);
  }
  fail_field(path_of(key), show_value(v), rule);
}

int64_t Fields::integer_or(const std::string& key, int64_t fallback, int64_t lo, int64_t hi) {
  if (!has(key)) {
    seen_.insert(key);
    return fallback;
  }
  return integer(key, lo, hi);
}

double Fields::real(const std::string& key, double lo, double hi) {
  const Json& v = get(key, "number");
  if (!v.is_number())
    fail_field(path_of(key), show_value(v), fmt::format("must be a number in [{}, {}]", lo, hi));
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < lo || d > hi)
    fail_field(path_of(key), show_value(v), fmt::format("must be a number in [{}, {}]", lo, hi));
  return d;
}

double Fields::real_or(const std::string& key, double fallback, double lo, double hi) {
  if (!has(key)) {
    seen_.insert(key);
    return fallback;
  }
  return real(key, lo, hi);
}

bool Fields::boolean_or(const std::string& key, bool fallback) {
  if (!has(key)) {
    seen_.insert(key);
    return fallback;
  }
  return flag_value(get(key, "boolean"), path_of(key));
}

std::string Fields::string(const std::string& key) {
  const Json& v = get(key, "string");
  if (!v.is_string()) fail_field(path_of(key), show_value(v), "must be a string");
  return v.get<std::string>();
}

std::string Fields::string_or(const std::string& key, const std::string& fallback) {
  if (!has(key)) {
    seen_.insert(key);
    return fallback;
  }
  return string(key);
}

std::string Fields::choice_or(const std::string& key, const std::string& fallback,
                              std::initializer_list<const char*> allowed) {
  const std::string s = string_or(key, fallback);
  // In any case: "RMSNorm" and "LayerNorm" are Megatron's own spellings, "BF16" a common one.
  std::string lower = s;
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  std::string list;
  for (const char* a : allowed) {
    if (lower == a) return lower;
    list += (list.empty() ? "" : ", ") + std::string("\"") + a + "\"";
  }
  fail_field(path_of(key), show_value(Json(s)), "must be one of " + list);
}

void adopt_key(Json& j, const std::string& source, const char* from, const char* to, ConvertValue convert) {
  if (!j.is_object() || !j.contains(from)) return;
  const std::string path = source + "." + from;
  // Named as written, before it takes the schema's name (DeepSpeed's "auto" placeholders).
  if (j.at(from) == "auto") fail_field(path, "\"auto\"", "strata needs the value");
  Json value = j.at(from).is_null() ? Json() : convert ? convert(j.at(from), path) : j.at(from);
  j.erase(from);
  if (value.is_null()) return;  // says nothing (null, or a flag set to false)
  if (j.contains(to) && j.at(to) != value)
    throw InputError(fmt::format("{}: {} means {} {}, but {} is {} (given under this or another name): keep one",
                                 path, show_value(value), to, show_value(value), to, show_value(j.at(to))));
  j[to] = std::move(value);
}

bool flag_value(const Json& v, const std::string& path) {
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number_integer() && (v.get<int64_t>() == 0 || v.get<int64_t>() == 1)) return v.get<int64_t>() == 1;
  fail_field(path, show_value(v), "must be true or false");
}

const Json& Fields::object(const std::string& key) {
  const Json& v = get(key, "object");
  if (!v.is_object()) fail_field(path_of(key), show_value(v), "must be a JSON object");
  return v;
}

const Json& Fields::array(const std::string& key) {
  const Json& v = get(key, "array");
  if (!v.is_array()) fail_field(path_of(key), show_value(v), "must be a JSON array");
  return v;
}

void Fields::reject_unknown_except(std::initializer_list<const char*> known) const {
  for (auto it = obj_.begin(); it != obj_.end(); ++it)
    if (std::none_of(known.begin(), known.end(), [&](const char* k) { return it.key() == k; })) unknown(it.key());
}

void Fields::reject_unknown() const {
  for (auto it = obj_.begin(); it != obj_.end(); ++it)
    if (!seen_.count(it.key())) unknown(it.key());
}

void Fields::unknown(const std::string& key) const {
  throw InputError(fmt::format("{}: unknown field (check the spelling; see the schema in README.md)", path_of(key)));
}

}  // namespace strata
