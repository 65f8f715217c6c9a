// `import dblast_ext._C` loads this library and so registers the ops (csrc/ops.cpp); the
// module itself is empty. The CMake build leaves this file out: its library is loaded with
// torch.ops.load_library instead.
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
