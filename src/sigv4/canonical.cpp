// The canonical request, string to sign, signing key and signature of SigV4.
#include <algorithm>
#include <cctype>
#include <ctime>
#include <map>

#include "sigv4/sigv4.hpp"

namespace rlloop::sigv4 {

namespace {
std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}
bool is_unreserved(unsigned char c) { return std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~'; }
int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
int digits(std::string_view s, std::size_t pos, std::size_t n) {
  int v = 0;
  for (std::size_t i = pos; i < pos + n; ++i) {
    if (i >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i]))) return -1;
    v = v * 10 + (s[i] - '0');
  }
  return v;
}
clock::time_point make_time(int y, int mo, int d, int h, int mi, int s, std::string_view text) {
  if (y < 1970 || mo < 1 || mo > 12 || d < 1 || d > 31 || h > 23 || mi > 59 || s > 60)
    throw invalid_argument("sigv4: invalid date '" + std::string(text) + "'");
  std::tm tm{};
  tm.tm_year = y - 1900;
  tm.tm_mon = mo - 1;
  tm.tm_mday = d;
  tm.tm_hour = h;
  tm.tm_min = mi;
  tm.tm_sec = s;
  return clock::from_time_t(timegm(&tm));
}
}  // namespace

std::optional<std::string> HttpRequest::header(std::string_view name) const {
  const std::string key = lower(name);
  for (const auto& [k, v] : headers)
    if (lower(k) == key) return v;
  return std::nullopt;
}

void HttpRequest::set_header(std::string name, std::string value) {
  const std::string key = lower(name);
  std::erase_if(headers, [&](const auto& h) { return lower(h.first) == key; });
  headers.emplace_back(std::move(name), std::move(value));
}

std::string format_amz_date(clock::time_point t) {
  const std::time_t tt = clock::to_time_t(t);
  std::tm tm{};
  gmtime_r(&tt, &tm);
  char buf[17];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

clock::time_point parse_amz_date(std::string_view s) {
  if (s.size() != 16 || s[8] != 'T' || s[15] != 'Z')
    throw invalid_argument("sigv4: invalid X-Amz-Date '" + std::string(s) + "'");
  const int y = digits(s, 0, 4), mo = digits(s, 4, 2), d = digits(s, 6, 2), h = digits(s, 9, 2), mi = digits(s, 11, 2),
            sec = digits(s, 13, 2);
  if (std::min({y, mo, d, h, mi, sec}) < 0)
    throw invalid_argument("sigv4: invalid X-Amz-Date '" + std::string(s) + "'");
  return make_time(y, mo, d, h, mi, sec, s);
}

clock::time_point parse_iso8601(std::string_view s) {
  if (s.size() != 20 || s[4] != '-' || s[7] != '-' || s[10] != 'T' || s[13] != ':' || s[16] != ':' || s[19] != 'Z')
    throw invalid_argument("sigv4: invalid timestamp '" + std::string(s) + "'");
  const int y = digits(s, 0, 4), mo = digits(s, 5, 2), d = digits(s, 8, 2), h = digits(s, 11, 2), mi = digits(s, 14, 2),
            sec = digits(s, 17, 2);
  if (std::min({y, mo, d, h, mi, sec}) < 0) throw invalid_argument("sigv4: invalid timestamp '" + std::string(s) + "'");
  return make_time(y, mo, d, h, mi, sec, s);
}

std::string uri_encode(std::string_view s, bool keep_slash) {
  static constexpr char digits_hex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if (is_unreserved(c) || (keep_slash && c == '/')) {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(digits_hex[c >> 4]);
      out.push_back(digits_hex[c & 15]);
    }
  }
  return out;
}

std::string uri_decode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && hex_value(s[i + 1]) >= 0 && hex_value(s[i + 2]) >= 0) {
      out.push_back(static_cast<char>(hex_value(s[i + 1]) * 16 + hex_value(s[i + 2])));
      i += 2;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// RFC 3986 dot-segment removal plus collapsing empty segments ("//"); a trailing slash survives.
std::string canonical_path(std::string_view path, bool normalize) {
  if (path.empty()) return "/";
  if (!normalize) return uri_encode(path, true);
  std::vector<std::string_view> segments;
  std::size_t start = 0;
  while (start <= path.size()) {
    std::size_t end = path.find('/', start);
    if (end == std::string_view::npos) end = path.size();
    const std::string_view seg = path.substr(start, end - start);
    if (seg == "..") {
      if (!segments.empty()) segments.pop_back();
    } else if (!seg.empty() && seg != ".") {
      segments.push_back(seg);
    }
    start = end + 1;
  }
  std::string out = "/";
  for (std::size_t i = 0; i < segments.size(); ++i) {
    if (i) out += '/';
    out += segments[i];
  }
  const bool trailing = path.back() == '/';
  if (trailing && out.size() > 1) out += '/';
  return uri_encode(out, true);
}

std::string canonical_query(std::string_view query, const std::vector<std::string>& skip) {
  std::vector<std::pair<std::string, std::string>> params;
  std::size_t start = 0;
  while (start < query.size()) {
    std::size_t end = query.find('&', start);
    if (end == std::string_view::npos) end = query.size();
    const std::string_view part = query.substr(start, end - start);
    start = end + 1;
    if (part.empty()) continue;
    const std::size_t eq = part.find('=');
    std::string key = uri_decode(part.substr(0, eq));
    std::string value = eq == std::string_view::npos ? "" : uri_decode(part.substr(eq + 1));
    if (std::find(skip.begin(), skip.end(), key) != skip.end()) continue;
    params.emplace_back(uri_encode(key, false), uri_encode(value, false));
  }
  std::sort(params.begin(), params.end());
  std::string out;
  for (const auto& [k, v] : params) out += (out.empty() ? "" : "&") + k + "=" + v;
  return out;
}

std::string canonical_header_value(std::string_view value) {
  std::string out;
  bool pending_space = false;
  for (unsigned char c : value) {
    if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
      pending_space = !out.empty();
      continue;
    }
    if (pending_space) out.push_back(' ');
    pending_space = false;
    out.push_back(static_cast<char>(c));
  }
  return out;
}

CanonicalHeaders canonical_headers(const HttpRequest& req, const std::vector<std::string>& names) {
  std::map<std::string, std::string> values;  // sorted by lowercase name; duplicates joined in arrival order
  for (const auto& name : names) values[lower(name)];
  std::map<std::string, bool> seen;
  for (const auto& [k, v] : req.headers) {
    const std::string key = lower(k);
    auto it = values.find(key);
    if (it == values.end()) continue;
    if (seen[key]) it->second += ",";
    seen[key] = true;
    it->second += canonical_header_value(v);
  }
  CanonicalHeaders out;
  for (const auto& [k, v] : values) {
    if (!seen[k]) throw invalid_argument("sigv4: signed header '" + k + "' is not in the request");
    out.block += k + ":" + v + "\n";
    out.signed_headers += (out.signed_headers.empty() ? "" : ";") + k;
  }
  return out;
}

std::string canonical_request(const HttpRequest& req, const std::vector<std::string>& signed_names, bool normalize_path,
                              std::string_view payload_hash_hex, const std::vector<std::string>& query_skip) {
  const std::string_view target = req.target;
  const std::size_t q = target.find('?');
  const std::string_view path = target.substr(0, q);
  const std::string_view query = q == std::string_view::npos ? std::string_view{} : target.substr(q + 1);
  const CanonicalHeaders h = canonical_headers(req, signed_names);
  return req.method + "\n" + canonical_path(path, normalize_path) + "\n" + canonical_query(query, query_skip) + "\n" +
         h.block + "\n" + h.signed_headers + "\n" + std::string(payload_hash_hex);
}

std::string credential_scope(std::string_view date8, std::string_view region, std::string_view service) {
  return std::string(date8) + "/" + std::string(region) + "/" + std::string(service) + "/aws4_request";
}

std::string string_to_sign(std::string_view amz_date, std::string_view scope, std::string_view creq) {
  return "AWS4-HMAC-SHA256\n" + std::string(amz_date) + "\n" + std::string(scope) + "\n" + hex(sha256(creq));
}

std::string signing_key(std::string_view secret, std::string_view date8, std::string_view region,
                        std::string_view service) {
  const std::string k_date = hmac_sha256("AWS4" + std::string(secret), date8);
  const std::string k_region = hmac_sha256(k_date, region);
  const std::string k_service = hmac_sha256(k_region, service);
  return hmac_sha256(k_service, "aws4_request");
}

std::string signature(std::string_view key, std::string_view sts) { return hex(hmac_sha256(key, sts)); }

}  // namespace rlloop::sigv4
