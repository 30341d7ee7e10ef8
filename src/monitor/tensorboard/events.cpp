#include "monitor/tensorboard/events.h"

#include "event.pb.h"

namespace dtrain::tensorboard {
namespace {

namespace pb = dtrain::tensorboard::proto;

std::string serialized(const pb::Event& e) {
  std::string out;
  e.SerializeToString(&out);
  return out;
}

pb::Event summary_event(int64_t step, double wall_time) {
  pb::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  return e;
}

}  // namespace

std::string file_version_event(double wall_time) {
  pb::Event e;
  e.set_wall_time(wall_time);
  e.set_file_version("brain.Event:2");
  return serialized(e);
}

std::string scalar_event(const std::string& tag, float value, int64_t step, double wall_time) {
  pb::Event e = summary_event(step, wall_time);
  pb::Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(value);
  return serialized(e);
}

std::string histogram_event(const std::string& tag, const Histogram& h, int64_t step, double wall_time) {
  pb::Event e = summary_event(step, wall_time);
  pb::Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  pb::HistogramProto* p = v->mutable_histo();
  p->set_min(h.min);
  p->set_max(h.max);
  p->set_num(h.num);
  p->set_sum(h.sum);
  p->set_sum_squares(h.sum_squares);
  p->mutable_bucket_limit()->Add(h.bucket_limit.begin(), h.bucket_limit.end());
  p->mutable_bucket()->Add(h.bucket.begin(), h.bucket.end());
  return serialized(e);
}

std::string text_event(const std::string& tag, const std::string& text, int64_t step, double wall_time) {
  pb::Event e = summary_event(step, wall_time);
  pb::Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag(tag + "/text_summary");
  // PyTorch writes TextPluginData(version=0), whose serialization is empty: the content stays empty.
  v->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
  pb::TensorProto* t = v->mutable_tensor();
  t->set_dtype(pb::DT_STRING);
  t->mutable_tensor_shape()->add_dim()->set_size(1);
  t->add_string_val(text);
  return serialized(e);
}

}  // namespace dtrain::tensorboard
