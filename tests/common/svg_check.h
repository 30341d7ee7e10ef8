// A minimal well-formedness check of the SVG files dtrain writes (tests only): an XML header, tags
// balanced and properly nested, one <svg> root; and the number of points of each <polyline>.
#pragma once

#include <sstream>
#include <string>
#include <vector>

namespace dtrain::test_util {

// "" when well-formed, else what is wrong.
inline std::string svg_problem(const std::string& doc) {
  if (doc.rfind("<?xml", 0) != 0) return "no XML header";
  std::vector<std::string> open;
  int roots = 0;
  size_t i = doc.find("?>");
  if (i == std::string::npos) return "unterminated XML header";
  for (i += 2; (i = doc.find('<', i)) != std::string::npos;) {
    const size_t end = doc.find('>', i);
    if (end == std::string::npos) return "unterminated tag at " + std::to_string(i);
    std::string tag = doc.substr(i + 1, end - i - 1);
    if (tag.find('<') != std::string::npos) return "'<' inside a tag at " + std::to_string(i);
    if (!tag.empty() && tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (open.empty() || open.back() != name)
        return "</" + name + "> does not close <" + (open.empty() ? "" : open.back()) + ">";
      open.pop_back();
    } else if (!tag.empty() && tag.back() == '/') {
      if (open.empty()) return "element outside the root";
    } else {
      const std::string name = tag.substr(0, tag.find_first_of(" \t\n"));
      if (open.empty()) {
        if (name != "svg") return "root is <" + name + ">";
        ++roots;
      }
      open.push_back(name);
    }
    i = end + 1;
  }
  if (!open.empty()) return "<" + open.back() + "> is never closed";
  if (roots != 1) return "expected one <svg> root, found " + std::to_string(roots);
  return "";
}

// Point counts of every <polyline points="..."> in order.
inline std::vector<int> polyline_point_counts(const std::string& doc) {
  std::vector<int> counts;
  for (size_t i = 0; (i = doc.find("<polyline", i)) != std::string::npos; ++i) {
    const size_t b = doc.find("points=\"", i) + 8, e = doc.find('"', b);
    std::istringstream pts(doc.substr(b, e - b));
    int n = 0;
    for (std::string p; pts >> p;) n += p.find(',') != std::string::npos;
    counts.push_back(n);
  }
  return counts;
}

}  // namespace dtrain::test_util
