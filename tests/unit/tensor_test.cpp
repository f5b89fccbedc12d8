// Tensor views and the planned parameter layout.
#include <gtest/gtest.h>

#include "core/arena.h"
#include "core/tensor.h"

namespace moe::testing {
namespace {

TEST(Tensor, ShapeStridesAndSlices) {
  std::vector<float> buf(2 * 3 * 4);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = float(i);
  Tensor t(buf.data(), DType::kF32, {2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.strides[0], 12);
  EXPECT_EQ(t.strides[2], 1);
  EXPECT_TRUE(t.is_contiguous());
  const Tensor s = t.slice_rows(1, 2);
  EXPECT_EQ(s.size(0), 1);
  EXPECT_EQ(s.ptr<float>()[0], 12.f);
  EXPECT_THROW(t.slice_rows(1, 3), Error);
  EXPECT_THROW(t.ptr<double>(), Error);  // dtype mismatch names both types
  try {
    t.ptr<int32_t>();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected i32, got f32"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Tensor(buf.data(), DType::kF32, {1, 2, 3, 4, 5, 6, 7}), Error);
  EXPECT_EQ(shape_str({2, 3}), "[2, 3]");
}

TEST(ParamLayout, OffsetsAreAlignedAndNamesUnique) {
  ParamLayout p;
  p.add("a", {3, 5});
  p.add("b", {7}, /*decay=*/false);
  p.add("c", {2, 2, 2}, true, /*expert=*/true);
  EXPECT_EQ(p.find("a").offset, 0);
  EXPECT_EQ(p.find("b").offset, ParamLayout::kAlign);
  EXPECT_EQ(p.find("c").offset, 2 * ParamLayout::kAlign);
  EXPECT_EQ(p.param_count(), 15 + 7 + 8);
  EXPECT_EQ(p.total_numel(), 3 * ParamLayout::kAlign);
  EXPECT_FALSE(p.find("b").decay);
  EXPECT_TRUE(p.find("c").expert);
  EXPECT_THROW(p.add("a", {1}), Error);
  EXPECT_THROW(p.find("missing"), Error);
  std::vector<float> buf(p.total_numel());
  const Tensor c = p.view(buf.data(), "c");
  EXPECT_EQ(c.data, buf.data() + 2 * ParamLayout::kAlign);
  EXPECT_EQ(c.dims(), (Shape{2, 2, 2}));
}

}  // namespace
}  // namespace moe::testing
