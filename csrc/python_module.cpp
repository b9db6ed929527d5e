// The Python face of each shared object: an empty extension module on the limited API.
// Importing it is what loads the library, and loading it runs the static STABLE_TORCH_LIBRARY
// registrations; the ops themselves are reached through torch.ops.fusedops.
#include <Python.h>

#define FUSEDOPS_STR2(x) #x
#define FUSEDOPS_STR(x) FUSEDOPS_STR2(x)
#define FUSEDOPS_CAT2(a, b) a##b
#define FUSEDOPS_CAT(a, b) FUSEDOPS_CAT2(a, b)

static PyModuleDef fusedops_module_def = {
    PyModuleDef_HEAD_INIT, FUSEDOPS_STR(FUSEDOPS_MODULE_NAME), nullptr, -1,
    nullptr, nullptr, nullptr, nullptr, nullptr};

extern "C" __attribute__((visibility("default"))) PyObject*
FUSEDOPS_CAT(PyInit_, FUSEDOPS_MODULE_NAME)(void) {
  return PyModule_Create(&fusedops_module_def);
}
