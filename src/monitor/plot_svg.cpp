// svg_plot: panels of lines, markers and stacked areas in plain SVG 1.1 (no script, no outside
// plotting tool), so that plot.svg opens in any browser.
//
// Layout, top to bottom: the title, then per panel its title with a legend, the frame with a light
// grid at "nice" ticks (1, 2 or 5 x 10^k) labelled on both axes, and "step" under the x axis.
// Every point also gets a marker while a series has few of them: a run of one or two windows still
// shows its values (a polyline of one point draws nothing).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "dtrain/monitor.h"

namespace dtrain {
namespace {

constexpr double kWidth = 860, kPanelHeight = 180, kTop = 44, kLeft = 74, kRight = 24, kGap = 64;
constexpr size_t kMaxMarkers = 60;  // more points than this: the line alone reads better
constexpr const char* kPalette[] = {"#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e", "#17becf"};

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
  std::snprintf(buf, sizeof buf, "%.4g", std::abs(v) < 1e-12 ? 0.0 : v);
  return buf;
}

std::string coord(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

// Ticks at 1, 2 or 5 x 10^k covering [lo, hi] with about `want` intervals; lo/hi widen to the
// outer ticks so the grid meets the frame.
std::vector<double> nice_ticks(double& lo, double& hi, int want) {
  if (!(hi > lo)) hi = lo + (lo == 0 ? 1 : std::abs(lo) * 0.1);
  const double raw = (hi - lo) / want, mag = std::pow(10, std::floor(std::log10(raw))), f = raw / mag;
  const double step = (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
  lo = std::floor(lo / step + 1e-9) * step;
  hi = std::ceil(hi / step - 1e-9) * step;
  std::vector<double> t;
  for (double v = lo; v <= hi + step * 1e-6; v += step) t.push_back(v);
  return t;
}

using Points = std::vector<std::pair<double, double>>;

Points finite_points(const PlotSeries& s) {
  Points pts;
  for (size_t i = 0; i < std::min(s.x.size(), s.y.size()); ++i)
    if (std::isfinite(s.x[i]) && std::isfinite(s.y[i])) pts.emplace_back(s.x[i], s.y[i]);
  return pts;
}

struct Frame {
  double left, top, w, h, x0, x1, y0, y1;
  double px(double x) const { return left + (x - x0) / (x1 - x0) * w; }
  double py(double y) const { return top + h - (y - y0) / (y1 - y0) * h; }
};

// Grid, tick labels and the frame itself.
void draw_axes(std::ostringstream& os, const Frame& f, const std::vector<double>& xt, const std::vector<double>& yt) {
  os << "<g stroke=\"#e3e3e3\" stroke-width=\"1\">\n";
  for (double x : xt)
    os << "<line x1=\"" << coord(f.px(x)) << "\" y1=\"" << coord(f.top) << "\" x2=\"" << coord(f.px(x)) << "\" y2=\""
       << coord(f.top + f.h) << "\"/>\n";
  for (double y : yt)
    os << "<line x1=\"" << coord(f.left) << "\" y1=\"" << coord(f.py(y)) << "\" x2=\"" << coord(f.left + f.w)
       << "\" y2=\"" << coord(f.py(y)) << "\"/>\n";
  os << "</g>\n<g fill=\"#444\" font-size=\"11\">\n";
  for (double x : xt)
    os << "<text x=\"" << coord(f.px(x)) << "\" y=\"" << coord(f.top + f.h + 14) << "\" text-anchor=\"middle\">"
       << num(x) << "</text>\n";
  for (double y : yt)
    os << "<text x=\"" << coord(f.left - 6) << "\" y=\"" << coord(f.py(y) + 4) << "\" text-anchor=\"end\">" << num(y)
       << "</text>\n";
  os << "<text x=\"" << coord(f.left + f.w / 2) << "\" y=\"" << coord(f.top + f.h + 30)
     << "\" text-anchor=\"middle\">step</text>\n</g>\n"
     << "<rect x=\"" << coord(f.left) << "\" y=\"" << coord(f.top) << "\" width=\"" << coord(f.w) << "\" height=\""
     << coord(f.h) << "\" fill=\"none\" stroke=\"#888\"/>\n";
}

void draw_line(std::ostringstream& os, const Frame& f, const Points& pts, const std::string& color, bool hollow) {
  os << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2\""
     << (hollow ? " stroke-dasharray=\"6 4\"" : "") << " points=\"";
  for (size_t i = 0; i < pts.size(); ++i)
    os << (i ? " " : "") << coord(f.px(pts[i].first)) << "," << coord(f.py(pts[i].second));
  os << "\"/>\n";
  if (pts.size() > kMaxMarkers) return;
  // Rings around dots: a point of both kinds at one place (one window, one epoch) shows both.
  if (hollow)
    os << "<g fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2.5\">\n";
  else
    os << "<g fill=\"" << color << "\">\n";
  for (const auto& p : pts)
    os << "<circle cx=\"" << coord(f.px(p.first)) << "\" cy=\"" << coord(f.py(p.second)) << "\" r=\""
       << (hollow ? "6" : "3.5") << "\"/>\n";
  os << "</g>\n";
}

// Series k's band between the sum of series 0..k-1 and of 0..k (the series share their x values;
// one point becomes a bar, since an area needs two).
void draw_stack(std::ostringstream& os, const Frame& f, const std::vector<Points>& pts,
                const std::vector<std::string>& colors) {
  std::vector<double> base(pts.empty() ? 0 : pts[0].size(), 0.0);
  for (size_t k = 0; k < pts.size(); ++k) {
    const Points& p = pts[k];
    if (p.size() != base.size()) continue;  // a series with gaps cannot be stacked on the others
    std::vector<double> xs;
    for (const auto& q : p) xs.push_back(f.px(q.first));
    if (xs.size() == 1) xs = {xs[0] - 8, xs[0] + 8};
    os << "<polygon fill=\"" << colors[k] << "\" stroke=\"none\" points=\"";
    for (size_t i = 0; i < xs.size(); ++i) {
      const size_t j = std::min(i, p.size() - 1);
      os << (i ? " " : "") << coord(xs[i]) << "," << coord(f.py(base[j] + p[j].second));
    }
    for (size_t i = xs.size(); i-- > 0;) {
      const size_t j = std::min(i, p.size() - 1);
      os << " " << coord(xs[i]) << "," << coord(f.py(base[j]));
    }
    os << "\"/>\n";
    for (size_t j = 0; j < p.size(); ++j) base[j] += p[j].second;
  }
}

void draw_panel(std::ostringstream& os, const PlotPanel& panel, double top, double x_lo, double x_hi) {
  const double w = kWidth - kLeft - kRight, h = kPanelHeight;
  std::vector<Points> pts;
  std::vector<std::string> colors;
  bool any = false;
  double y_lo = panel.stacked ? 0 : INFINITY, y_hi = -INFINITY;
  std::vector<double> sums;
  for (size_t k = 0; k < panel.series.size(); ++k) {
    pts.push_back(finite_points(panel.series[k]));
    colors.push_back(panel.series[k].color.empty() ? kPalette[k % 6] : panel.series[k].color);
    any |= !pts.back().empty();
    if (panel.stacked) {
      sums.resize(std::max(sums.size(), pts.back().size()), 0.0);
      for (size_t j = 0; j < pts.back().size(); ++j) sums[j] += std::max(0.0, pts.back()[j].second);
    }
    for (const auto& p : pts.back()) {
      y_lo = std::min(y_lo, p.second), y_hi = std::max(y_hi, p.second);
      if (!std::isfinite(x_lo)) x_lo = p.first;
      if (!std::isfinite(x_hi)) x_hi = p.first;
      x_lo = std::min(x_lo, p.first), x_hi = std::max(x_hi, p.first);
    }
  }
  for (double s : sums) y_hi = std::max(y_hi, s);
  // Title and legend (a legend only when the panel has several series).
  os << "<g>\n<text x=\"" << kLeft << "\" y=\"" << coord(top - 10) << "\" font-weight=\"bold\">" << escape(panel.title)
     << "</text>\n";
  if (panel.series.size() > 1) {
    double x = kLeft + w;
    for (size_t k = panel.series.size(); k-- > 0;) {
      const std::string& name = panel.series[k].title;
      x -= 7.0 * name.size() + 22;
      if (panel.series[k].hollow)
        os << "<circle cx=\"" << coord(x + 5.5) << "\" cy=\"" << coord(top - 14.5)
           << "\" r=\"4.5\" fill=\"none\" stroke=\"" << colors[k] << "\" stroke-width=\"2\"/>";
      else
        os << "<rect x=\"" << coord(x) << "\" y=\"" << coord(top - 20) << "\" width=\"11\" height=\"11\" fill=\""
           << colors[k] << "\"/>";
      os << "<text x=\"" << coord(x + 15) << "\" y=\"" << coord(top - 10) << "\" font-size=\"11\">" << escape(name)
         << "</text>\n";
    }
  }
  if (!any) {
    draw_axes(os, Frame{kLeft, top, w, h, 0, 1, 0, 1}, {}, {});
    os << "<text x=\"" << coord(kLeft + w / 2) << "\" y=\"" << coord(top + h / 2)
       << "\" text-anchor=\"middle\" fill=\"#888\">no data</text>\n</g>\n";
    return;
  }
  if (!panel.stacked) {  // a little room above and below the values; a single value in the middle
    const double pad = y_hi > y_lo ? (y_hi - y_lo) * 0.05 : (y_lo == 0 ? 1 : std::abs(y_lo) * 0.05);
    y_lo -= pad, y_hi += pad;
  }
  Frame f{kLeft, top, w, h, x_lo, x_hi, y_lo, y_hi};
  const auto xt = nice_ticks(f.x0, f.x1, 8), yt = nice_ticks(f.y0, f.y1, 5);
  draw_axes(os, f, xt, yt);
  if (panel.stacked)
    draw_stack(os, f, pts, colors);
  else
    for (size_t k = 0; k < pts.size(); ++k)
      if (!pts[k].empty()) draw_line(os, f, pts[k], colors[k], panel.series[k].hollow);
  os << "</g>\n";
}

}  // namespace

std::string svg_plot(const std::vector<PlotPanel>& panels, const std::string& title, double x_min, double x_max) {
  const double height = kTop + panels.size() * (kPanelHeight + kGap);
  std::ostringstream os;
  os << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
     << "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"" << kWidth << "\" height=\"" << height
     << "\" viewBox=\"0 0 " << kWidth << " " << height << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
     << "<rect x=\"0\" y=\"0\" width=\"" << kWidth << "\" height=\"" << height << "\" fill=\"white\"/>\n"
     << "<text x=\"" << kWidth / 2 << "\" y=\"20\" text-anchor=\"middle\" font-size=\"16\">" << escape(title)
     << "</text>\n";
  for (size_t k = 0; k < panels.size(); ++k)
    draw_panel(os, panels[k], kTop + 20 + k * (kPanelHeight + kGap), x_min, x_max);
  os << "</svg>\n";
  return os.str();
}

std::string svg_plot(const std::vector<PlotSeries>& series, const std::string& title) {
  std::vector<PlotPanel> panels;
  for (size_t k = 0; k < series.size(); ++k) {
    PlotSeries s = series[k];
    if (s.color.empty()) s.color = kPalette[k % 6];
    panels.push_back(PlotPanel{s.title, {s}, false});
  }
  return svg_plot(panels, title, NAN, NAN);
}

}  // namespace dtrain
