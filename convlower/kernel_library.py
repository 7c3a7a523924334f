"""One C++ translation unit for many of Inductor's CPU kernels, with a Python binding each.

Every kernel Inductor generates for the CPU is a translation unit with one ``extern "C" void
kernel(...)`` and its helpers.  :func:`library_source` puts several of them in one unit: each
kernel in a namespace of its own (C++ linkage, so equal helper names cannot clash), includes
hoisted, then one binding ``kernel_<i>`` per kernel that parses its arguments as Inductor's own
bindings do (tensors by torch's data-pointer function, whose address Inductor passes in the
environment).  Text only: building and loading are torch_kernel_batch.py's.
"""
from __future__ import annotations

import re

# the argument types the bindings below parse; any other kernel is built by Inductor itself
ARG_TYPES = re.compile(r"^(const )?[\w:]+\*$|^(int64_t|uintptr_t|float)$")
ENTRY = re.compile(r'extern\s+"C"\s+void\s+kernel\s*\(')


def bindable(argtypes, source: str) -> bool:
    """Whether ``source`` is one kernel this module can bind."""
    return (all(ARG_TYPES.match(t) for t in argtypes) and len(ENTRY.findall(source)) == 1
            and "PyInit_" not in source)


def library_source(kernels: list) -> str:
    """One translation unit: includes hoisted, each kernel in namespace ``k<i>`` (C++ linkage,
    so equal helper names cannot clash), then one Python binding ``kernel_<i>`` per kernel."""
    includes, bodies, bindings, table = [], [], [], []
    for i, (argtypes, source) in enumerate(kernels):
        lines = source.splitlines()
        includes += [ln for ln in lines if ln.startswith("#include") and ln not in includes]
        body = "\n".join(ln for ln in lines if not ln.startswith("#include"))
        bodies.append(f"namespace k{i} {{\n{ENTRY.sub('void kernel(', body)}\n}}")
        args = ", ".join(f"arg<{t.replace('const ', '')}>(args, {n})"
                         for n, t in enumerate(argtypes))
        bindings.append(_BINDING.format(i=i, n=len(argtypes), args=args))
        table.append(f'    {{"kernel_{i}", kernel_{i}_py, METH_VARARGS, ""}},')
    return "\n".join(includes + bodies + [_PRELUDE] + bindings + [
        _MODULE.format(table="\n".join(table))])


_PRELUDE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>

// torch's tensor -> data pointer function, passed by address as for Inductor's own bindings
static void* (*tensor_data_ptr)(PyObject* obj);

template <typename T> static inline T arg(PyObject* args, size_t n) {
    static_assert(std::is_pointer_v<T>, "arg type must be pointer or number");
    return static_cast<T>(tensor_data_ptr(PyTuple_GET_ITEM(args, n)));
}
#define ARG_OR_THROW(r, bad) if ((r) == (bad) && PyErr_Occurred()) throw std::runtime_error("bad arg")
template <> inline int64_t arg<int64_t>(PyObject* args, size_t n) {
    auto r = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n)); ARG_OR_THROW(r, -1); return r; }
template <> inline uintptr_t arg<uintptr_t>(PyObject* args, size_t n) {
    auto r = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    ARG_OR_THROW(r, reinterpret_cast<void*>(-1)); return reinterpret_cast<uintptr_t>(r); }
template <> inline float arg<float>(PyObject* args, size_t n) {
    auto r = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n)); ARG_OR_THROW(r, -1.0);
    return static_cast<float>(r); }
"""

_BINDING = """
static PyObject* kernel_{i}_py(PyObject* self, PyObject* args) {{
    try {{
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {n})
            throw std::runtime_error("kernel_{i} takes {n} args");
        k{i}::kernel({args});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }}
}}
"""

_MODULE = """
static PyMethodDef methods[] = {{
{table}
    {{NULL, NULL, 0, NULL}}}};

static struct PyModuleDef module_def = {{PyModuleDef_HEAD_INIT, "kernels", NULL, -1, methods}};

PyMODINIT_FUNC PyInit_kernels(void) {{
    const char* addr = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    char* end = nullptr;
    errno = 0;
    uintptr_t p = addr ? std::strtoull(addr, &end, 10) : 0;
    if (!addr || errno != 0 || end == addr || p == 0) {{
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR not set");
        return nullptr;
    }}
    tensor_data_ptr = reinterpret_cast<decltype(tensor_data_ptr)>(p);
    return PyModule_Create(&module_def);
}}
"""
