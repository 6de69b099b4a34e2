// The Python bindings of the fbs native extension (fbs.native): every kernel's entry point, in one place.
#include <pybind11/stl.h>

#include "attention.h"
#include "causal.h"
#include "chunk.h"
#include "evict.h"
#include "gate.h"
#include "int8.h"
#include "layer.h"
#include "norm.h"
#include "packed.h"
#include "paw.h"
#include "quant.h"
#include "rowquant.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gate_logits", &gate_logits);
  m.def("int8_linear", &int8_linear);
  m.def("int8_isa", &int8_isa);
  m.def("attend_one", &attend_one);
  m.def("attention_int8_scores", &attention_int8_scores, py::arg("on") = py::none());
  m.def("causal_attention", &causal_attention);
  m.def("causal_available", &causal_available);
  m.def("rms_norm", &rms_norm);
  m.def("linear_rows", &linear_rows);
  m.def("quant_isa", &quant_isa);
  m.def("quant_activations", &quant_activations);
  m.def("quant_linear", &quant_linear);
  m.def("chunk_step", &chunk_step);
  m.def("paw_step", &paw_step);
  m.def("h2o_evict", &h2o_evict);
  m.def("quantize_rows", &quantize_rows);
  m.def("scale_rows", &scale_rows);
  pybind11::class_<fbs_packed::Packed>(m, "PackedWeight")
      .def(pybind11::init(&fbs_packed::make))
      .def_readonly("kind", &fbs_packed::Packed::kind)
      .def_readonly("n", &fbs_packed::Packed::n)
      .def_readonly("k", &fbs_packed::Packed::k)
      .def("set_lowrank", &fbs_packed::Packed::set_lowrank)
      .def("linear", &fbs_packed::Packed::linear);
  pybind11::class_<fbs_layer::Layer>(m, "NativeLayer")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor,
                          const fbs_packed::Packed&, std::optional<at::Tensor>, const fbs_packed::Packed&,
                          std::optional<at::Tensor>, const fbs_packed::Packed&, at::Tensor, const fbs_packed::Packed&,
                          const fbs_packed::Packed&>())
      .def("set_gate", &fbs_layer::Layer::set_gate)
      .def("set_paw", &fbs_layer::Layer::set_paw)
      .def("set_chunk", &fbs_layer::Layer::set_chunk);
  m.def("run_layers", &fbs_layer::run_layers);
  m.def("attend_layer", &fbs_layer::attend_layer, py::arg("layer"), py::arg("x"), py::arg("xn"), py::arg("cos"),
        py::arg("sin"), py::arg("kc"), py::arg("vc"), py::arg("idx"), py::arg("slots"), py::arg("k"), py::arg("v"),
        py::arg("acc"), py::arg("isa"), py::arg("tree_bits") = py::none(), py::arg("tree_base") = py::none(),
        py::arg("kf") = py::none());
  m.def("ffn_layer", &fbs_layer::ffn_layer);
}
