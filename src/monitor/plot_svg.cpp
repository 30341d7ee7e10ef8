// svg_plot: panels of polylines in plain SVG 1.1, no outside plotting tool.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "dtrain/monitor.h"

namespace dtrain {
namespace {

constexpr double kWidth = 760, kPanelHeight = 200, kTop = 40, kLeft = 80, kRight = 20, kGap = 40;

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

std::string coord(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

}  // namespace

std::string svg_plot(const std::vector<PlotSeries>& series, const std::string& title) {
  const double height = kTop + series.size() * (kPanelHeight + kGap);
  std::ostringstream os;
  os << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
     << "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"" << kWidth << "\" height=\"" << height
     << "\" viewBox=\"0 0 " << kWidth << " " << height << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
     << "<rect x=\"0\" y=\"0\" width=\"" << kWidth << "\" height=\"" << height << "\" fill=\"white\"/>\n"
     << "<text x=\"" << kWidth / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"16\">" << escape(title)
     << "</text>\n";
  const char* colors[] = {"#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e"};
  for (size_t k = 0; k < series.size(); ++k) {
    const PlotSeries& s = series[k];
    const double top = kTop + k * (kPanelHeight + kGap), w = kWidth - kLeft - kRight, h = kPanelHeight;
    std::vector<std::pair<double, double>> pts;
    for (size_t i = 0; i < std::min(s.x.size(), s.y.size()); ++i)
      if (std::isfinite(s.x[i]) && std::isfinite(s.y[i])) pts.emplace_back(s.x[i], s.y[i]);
    os << "<g>\n<text x=\"" << kLeft << "\" y=\"" << coord(top - 6) << "\" font-weight=\"bold\">" << escape(s.title)
       << "</text>\n"
       << "<rect x=\"" << kLeft << "\" y=\"" << coord(top) << "\" width=\"" << w << "\" height=\"" << h
       << "\" fill=\"none\" stroke=\"#888\"/>\n";
    if (pts.empty()) {
      os << "<text x=\"" << coord(kLeft + w / 2) << "\" y=\"" << coord(top + h / 2)
         << "\" text-anchor=\"middle\" fill=\"#888\">no data</text>\n</g>\n";
      continue;
    }
    double x0 = pts.front().first, x1 = x0, y0 = pts.front().second, y1 = y0;
    for (auto& p : pts) {
      x0 = std::min(x0, p.first), x1 = std::max(x1, p.first);
      y0 = std::min(y0, p.second), y1 = std::max(y1, p.second);
    }
    if (x1 == x0) x1 = x0 + 1;
    if (y1 == y0) y1 = y0 + (y0 == 0 ? 1 : std::abs(y0) * 0.1);
    auto px = [&](double x) { return kLeft + (x - x0) / (x1 - x0) * w; };
    auto py = [&](double y) { return top + h - (y - y0) / (y1 - y0) * h; };
    // Axis labels: y min/max at the left, x min/max below.
    os << "<text x=\"" << kLeft - 6 << "\" y=\"" << coord(top + 4) << "\" text-anchor=\"end\">" << num(y1)
       << "</text>\n"
       << "<text x=\"" << kLeft - 6 << "\" y=\"" << coord(top + h) << "\" text-anchor=\"end\">" << num(y0)
       << "</text>\n"
       << "<text x=\"" << kLeft << "\" y=\"" << coord(top + h + 16) << "\">" << num(x0) << "</text>\n"
       << "<text x=\"" << coord(kLeft + w) << "\" y=\"" << coord(top + h + 16) << "\" text-anchor=\"end\">" << num(x1)
       << "</text>\n"
       << "<text x=\"" << coord(kLeft + w / 2) << "\" y=\"" << coord(top + h + 16)
       << "\" text-anchor=\"middle\" fill=\"#555\">step</text>\n";
    os << "<polyline fill=\"none\" stroke=\"" << colors[k % 5] << "\" stroke-width=\"1.5\" points=\"";
    for (size_t i = 0; i < pts.size(); ++i)
      os << (i ? " " : "") << coord(px(pts[i].first)) << "," << coord(py(pts[i].second));
    os << "\"/>\n</g>\n";
  }
  os << "</svg>\n";
  return os.str();
}

}  // namespace dtrain
