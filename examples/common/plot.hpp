// A self-contained SVG line plot of chosen series of metrics records (MetricsLog::records()): what the examples
// write beside their metrics.jsonl. Demo code, so it lives with the examples, not in the library.
#pragma once
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>

namespace rlloop::examples {

// Plots the numeric fields `keys` of the records against their index (or `x_key`), one line each, y in [0, 1]
// unless a value leaves that range. Records without a key are skipped for that series.
inline void write_svg_plot(const std::string& path, const std::vector<nlohmann::json>& records,
                           const std::vector<std::string>& keys, const std::string& x_key, const std::string& title) {
  const double W = 720, H = 400, L = 60, R = 160, T = 40, B = 50;
  double xmin = 1e300, xmax = -1e300, ymin = 0, ymax = 1;
  std::map<std::string, std::vector<std::pair<double, double>>> series;
  for (std::size_t i = 0; i < records.size(); ++i) {
    const auto& r = records[i];
    const double x = r.contains(x_key) && r[x_key].is_number() ? r[x_key].get<double>() : static_cast<double>(i);
    for (const auto& k : keys)
      if (r.contains(k) && r[k].is_number()) {
        const double y = r[k].get<double>();
        series[k].emplace_back(x, y);
        xmin = std::min(xmin, x), xmax = std::max(xmax, x);
        ymin = std::min(ymin, y), ymax = std::max(ymax, y);
      }
  }
  if (xmin > xmax) xmin = 0, xmax = 1;
  if (xmax == xmin) xmax = xmin + 1;
  auto px = [&](double x) { return L + (x - xmin) / (xmax - xmin) * (W - L - R); };
  auto py = [&](double y) { return H - B - (y - ymin) / (ymax - ymin) * (H - T - B); };
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"};
  std::ostringstream svg;
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H
      << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n"
      << "<text x='" << L << "' y='24' font-size='15'>" << title << "</text>\n";
  for (int g = 0; g <= 4; ++g) {
    const double y = ymin + (ymax - ymin) * g / 4.0;
    svg << "<line x1='" << L << "' x2='" << W - R << "' y1='" << py(y) << "' y2='" << py(y)
        << "' stroke='#ddd'/><text x='" << L - 8 << "' y='" << py(y) + 4 << "' text-anchor='end'>"
        << std::round(y * 100) / 100 << "</text>\n";
  }
  svg << "<text x='" << (L + W - R) / 2 << "' y='" << H - 12 << "' text-anchor='middle'>" << x_key << "</text>\n";
  int c = 0;
  for (const auto& k : keys) {
    const auto& pts = series[k];
    const char* color = colors[c % 6];
    svg << "<polyline fill='none' stroke='" << color << "' stroke-width='2' points='";
    for (const auto& [x, y] : pts) svg << px(x) << ',' << py(y) << ' ';
    svg << "'/>\n<text x='" << W - R + 10 << "' y='" << T + 20 + 18 * c << "' fill='" << color << "'>" << k
        << "</text>\n";
    ++c;
  }
  svg << "</svg>\n";
  std::ofstream out(path, std::ios::trunc);
  if (!out) throw io_error("write_svg_plot: cannot write '" + path + "'");
  out << svg.str();
}

}  // namespace rlloop::examples
