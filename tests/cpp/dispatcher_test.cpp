// A C++ program on libtorch that uses fusedops without Python: it links libfusedops (whose
// static registrations define the fusedops ops when it loads) and calls the ops through the
// dispatcher, checking values against ATen's own computation and that a bad argument raises
// the library's message. Run by ctest (CMakeLists.txt, FUSEDOPS_BUILD_TESTS=ON).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <tuple>

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

bool close(const at::Tensor& a, const at::Tensor& b, double tol) {
  return a.sizes() == b.sizes() && at::allclose(a.to(at::kDouble), b.to(at::kDouble), tol, tol);
}

// rms_norm(input, weight, eps, offset, cast_before_weight, save_output): a C++ caller passes
// every argument, defaults included.
using RmsNormSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                             double, double, bool, bool);

void test_rms_norm() {
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("fusedops::rms_norm", "")
                .typed<RmsNormSignature>();
  const at::Tensor x = at::randn({5, 3, 96}, at::kDouble), w = at::randn({96}, at::kDouble);
  auto [y, rstd] = op.call(x, w, 1e-6, 0.0, false, false);
  const at::Tensor expected_rstd = at::rsqrt(x.pow(2).mean(-1) + 1e-6);
  expect(close(y, x * expected_rstd.unsqueeze(-1) * w, 1e-12), "rms_norm output (float64, with weight)");
  expect(close(rstd, expected_rstd, 1e-12), "rms_norm rstd");
  auto [yb, rb] = op.call(x.to(at::kBFloat16), w.to(at::kFloat), 1e-6, 0.0, false, false);
  expect(yb.scalar_type() == at::kBFloat16 && close(yb, x * expected_rstd.unsqueeze(-1) * w, 2e-2),
         "rms_norm bfloat16 input with a float32 weight");
  auto [yg, rg] = op.call(x, w, 1e-6, 1.0, false, false);
  expect(close(yg, x * expected_rstd.unsqueeze(-1) * (w + 1), 1e-12), "rms_norm with offset 1 (Gemma)");
}

void test_add_rms_norm() {
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("fusedops::add_rms_norm", "")
                .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double, double, bool)>();
  const at::Tensor x = at::randn({6, 200}, at::kBFloat16), r = at::randn({6, 200}, at::kFloat);
  const at::Tensor w = at::randn({200}, at::kFloat);
  auto [y, h, rstd] = op.call(x, r, w, 1e-6, 0.0, false);
  const at::Tensor sum = x.to(at::kFloat) + r;
  expect(h.scalar_type() == at::kFloat && close(h, sum, 1e-6), "add_rms_norm residual_out (float32 residual)");
  const at::Tensor expected = sum * at::rsqrt(sum.pow(2).mean(-1, true) + 1e-6) * w;
  expect(y.scalar_type() == at::kBFloat16 && close(y, expected, 2e-2), "add_rms_norm output (bfloat16 input)");
}

void test_layer_norm() {
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("fusedops::layer_norm", "")
                .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                    const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double)>();
  const at::Tensor x = at::randn({7, 130}, at::kFloat) * 3 + 10;
  const at::Tensor w = at::randn({130}), b = at::randn({130});
  auto [y, mean, rstd] = op.call(x, w, b, 1e-5);
  expect(close(y, at::layer_norm(x, {130}, w, b, 1e-5), 1e-4), "layer_norm output against at::layer_norm");
  expect(close(mean, x.mean(-1), 1e-5), "layer_norm mean");
}

void test_bad_argument() {
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("fusedops::rms_norm", "")
                .typed<RmsNormSignature>();
  std::string message;
  try {
    op.call(at::randn({4, 8}), at::randn({7}), 1e-6, 0.0, false, false);
  } catch (const std::exception& e) {
    message = e.what();
  }
  expect(message.find("rms_norm: weight must be a 1-D tensor of size 8") != std::string::npos,
         "a bad weight raises the library's message (got: " + message.substr(0, 120) + ")");
}

}  // namespace

int main() {
  at::manual_seed(0);
  test_rms_norm();
  test_add_rms_norm();
  test_layer_norm();
  test_bad_argument();
  std::printf("%s\n", failures == 0 ? "all passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}
