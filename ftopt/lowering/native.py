"""A one-call native check of a list of tensors against cached fused tables.

Every cached fused step verifies, for each param, state and gradient tensor, its data
pointer, sizes, strides, dtype, device and ``requires_grad`` before a kernel reads or
writes it through a raw address (:mod:`ftopt.lowering.checks`). From Python that is one
C call per tensor and property (~55 ns each for the pointer alone; 593 tensors for a
148-leaf Adam step); torch's compiled-graph guards do the metadata in one call but not
the pointers. This module compiles a small C++ extension against the installed torch's
headers (the system C++ compiler, as Triton uses for its launchers) that checks
everything in one pass (~7 ns a tensor).

The build runs once per torch version and source (~12 s), in a background thread started
by the first fused step on an accelerator, into ``$FTOPT_CACHE_DIR/native`` (default
``~/.cache/ftopt/native``); later processes load it in milliseconds. Until it is loaded,
or where it cannot be built (no compiler, no headers), the checks run through torch's
guards and Python, with the same results: only host time differs. :func:`status` says
which is in use and why. ``FTOPT_NATIVE=0`` turns the extension off.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from types import ModuleType

import torch

from ftopt.lowering import knobs

SOURCE = r"""
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <cstdint>
#include <vector>

namespace {

// The recorded layout of n tensors; the first n_fixed pointers must stay the same.
struct Table {
  Py_ssize_t n = 0, n_fixed = 0;
  std::vector<int64_t> meta;     // per tensor: dtype, device type, index, requires_grad, ndim
  std::vector<int64_t> offsets;  // per tensor: its sizes then strides in `dims`
  std::vector<int64_t> dims;
  std::vector<std::uintptr_t> ptrs;
};

const char* kName = "ftopt.native.Table";

Table* table_of(PyObject* capsule) {
  return static_cast<Table*>(PyCapsule_GetPointer(capsule, kName));
}

void free_table(PyObject* capsule) { delete table_of(capsule); }

// The tensor at `o` with its pointer, or false where `o` is not a tensor with storage.
bool unpack(PyObject* o, const at::Tensor** out, std::uintptr_t* ptr) {
  if (!THPVariable_Check(o)) return false;
  const at::Tensor& t = THPVariable_Unpack(o);
  if (!t.defined() || t.layout() != c10::kStrided || !t.has_storage()) return false;
  *out = &t;
  *ptr = reinterpret_cast<std::uintptr_t>(t.unsafeGetTensorImpl()->data());
  return true;
}

void record_meta(const at::Tensor& t, std::vector<int64_t>* meta) {
  meta->push_back(static_cast<int64_t>(t.scalar_type()));
  meta->push_back(static_cast<int64_t>(t.device().type()));
  meta->push_back(static_cast<int64_t>(t.device().index()));
  meta->push_back(t.requires_grad() ? 1 : 0);
  meta->push_back(t.dim());
}

PyObject* make(PyObject*, PyObject* args) {
  PyObject* seq;
  Py_ssize_t n_fixed;
  if (!PyArg_ParseTuple(args, "On", &seq, &n_fixed)) return nullptr;
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of tensors");
  if (!fast) return nullptr;
  auto* table = new Table();
  table->n = PySequence_Fast_GET_SIZE(fast);
  table->n_fixed = n_fixed;
  PyObject** items = PySequence_Fast_ITEMS(fast);
  try {
    for (Py_ssize_t i = 0; i < table->n; ++i) {
      const at::Tensor* t;
      std::uintptr_t ptr;
      if (!unpack(items[i], &t, &ptr)) {
        delete table;
        Py_DECREF(fast);
        PyErr_SetString(PyExc_TypeError, "expected dense tensors with storage");
        return nullptr;
      }
      record_meta(*t, &table->meta);
      table->offsets.push_back(static_cast<int64_t>(table->dims.size()));
      for (int64_t s : t->sizes()) table->dims.push_back(s);
      for (int64_t s : t->strides()) table->dims.push_back(s);
      table->ptrs.push_back(ptr);
    }
  } catch (const std::exception& e) {
    delete table;
    Py_DECREF(fast);
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_DECREF(fast);
  return PyCapsule_New(table, kName, free_table);
}

// fit(table, parts, always_list) -> None | True | list of the pointers after n_fixed, for
// the tensors of `parts` (a tuple of tuples or lists of tensors) taken in order. None: a
// length, type or layout differs, or a fixed pointer moved. True: every pointer is the
// recorded one (unless always_list).
PyObject* fit(PyObject*, PyObject* args) {
  PyObject *capsule, *parts;
  int always_list;
  if (!PyArg_ParseTuple(args, "OO!p", &capsule, &PyTuple_Type, &parts, &always_list))
    return nullptr;
  Table* table = table_of(capsule);
  if (!table) return nullptr;
  const Py_ssize_t n_parts = PyTuple_GET_SIZE(parts);
  Py_ssize_t n = 0;
  for (Py_ssize_t j = 0; j < n_parts; ++j) {
    PyObject* part = PyTuple_GET_ITEM(parts, j);
    if (!PyTuple_Check(part) && !PyList_Check(part)) Py_RETURN_NONE;
    n += PySequence_Fast_GET_SIZE(part);
  }
  if (n != table->n) Py_RETURN_NONE;
  bool same = true, ok = true;
  std::vector<std::uintptr_t> moved;
  Py_ssize_t i = 0;
  try {
    for (Py_ssize_t j = 0; ok && j < n_parts; ++j) {
      PyObject* part = PyTuple_GET_ITEM(parts, j);
      const Py_ssize_t size = PySequence_Fast_GET_SIZE(part);
      PyObject** items = PySequence_Fast_ITEMS(part);
      for (Py_ssize_t k = 0; k < size; ++k, ++i) {
        const at::Tensor* t;
        std::uintptr_t ptr;
        if (!unpack(items[k], &t, &ptr)) { ok = false; break; }
        const int64_t* m = &table->meta[5 * i];
        const auto device = t->device();
        if (static_cast<int64_t>(t->scalar_type()) != m[0] ||
            static_cast<int64_t>(device.type()) != m[1] ||
            static_cast<int64_t>(device.index()) != m[2] ||
            (t->requires_grad() ? 1 : 0) != m[3] || t->dim() != m[4]) {
          ok = false;
          break;
        }
        const int64_t* d = &table->dims[table->offsets[i]];
        const auto sizes = t->sizes();
        const auto strides = t->strides();
        for (int64_t r = 0; ok && r < m[4]; ++r)
          ok = sizes[r] == d[r] && strides[r] == d[m[4] + r];
        if (!ok) break;
        if (ptr != table->ptrs[i]) {
          if (i < table->n_fixed) { ok = false; break; }
          same = false;
        }
        if (i >= table->n_fixed) moved.push_back(ptr);
      }
    }
  } catch (const std::exception&) {
    ok = false;
  }
  if (!ok) Py_RETURN_NONE;
  if (same && !always_list) Py_RETURN_TRUE;
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(moved.size()));
  if (!out) return nullptr;
  for (size_t k = 0; k < moved.size(); ++k) {
    PyObject* v = PyLong_FromVoidPtr(reinterpret_cast<void*>(moved[k]));
    if (!v) { Py_DECREF(out); return nullptr; }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(k), v);
  }
  return out;
}

// record(table, pointers): the pointers after n_fixed that later fits compare against.
PyObject* record(PyObject*, PyObject* args) {
  PyObject *capsule, *seq;
  if (!PyArg_ParseTuple(args, "OO", &capsule, &seq)) return nullptr;
  Table* table = table_of(capsule);
  if (!table) return nullptr;
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of ints");
  if (!fast) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  if (n != table->n - table->n_fixed) {
    Py_DECREF(fast);
    PyErr_SetString(PyExc_ValueError, "wrong number of pointers");
    return nullptr;
  }
  std::vector<std::uintptr_t> ptrs(n);
  for (Py_ssize_t k = 0; k < n; ++k) {
    void* v = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(fast, k));
    if (PyErr_Occurred()) { Py_DECREF(fast); return nullptr; }
    ptrs[k] = reinterpret_cast<std::uintptr_t>(v);
  }
  Py_DECREF(fast);
  std::copy(ptrs.begin(), ptrs.end(), table->ptrs.begin() + table->n_fixed);
  Py_RETURN_NONE;
}

// grads(tensors) -> [t.grad for t in tensors] (None where a tensor has none), read as
// torch's `grad` getter reads it for a tensor with no __torch_function__ of its own.
PyObject* grads(PyObject*, PyObject* seq) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of tensors");
  if (!fast) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  PyObject* out = PyList_New(n);
  if (!out) { Py_DECREF(fast); return nullptr; }
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!THPVariable_Check(items[i])) {
        Py_DECREF(out);
        Py_DECREF(fast);
        PyErr_SetString(PyExc_TypeError, "expected tensors");
        return nullptr;
      }
      const at::Tensor& grad = THPVariable_Unpack(items[i]).grad();
      PyObject* g = grad.defined() ? THPVariable_Wrap(grad) : Py_NewRef(Py_None);
      if (!g) { Py_DECREF(out); Py_DECREF(fast); return nullptr; }
      PyList_SET_ITEM(out, i, g);
    }
  } catch (const std::exception& e) {
    Py_DECREF(out);
    Py_DECREF(fast);
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_DECREF(fast);
  return out;
}

PyMethodDef methods[] = {
    {"grads", grads, METH_O, "grads(tensors) -> list of their .grad"},
    {"make", make, METH_VARARGS, "make(tensors, n_fixed) -> table"},
    {"fit", fit, METH_VARARGS, "fit(table, parts, always_list) -> None | True | list"},
    {"record", record, METH_VARARGS, "record(table, pointers)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "MODULE_NAME", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_MODULE_NAME(void) { return PyModule_Create(&module); }
"""

_lock = threading.Lock()
_module: ModuleType | None = None
_state = "not started"  # or "building", "loaded", "off", "failed: ..."
_thread: threading.Thread | None = None


ON = knobs.switch("FTOPT_NATIVE", True, "the host's per-step checks in a C++ extension "
                  "built on first use (0: in Python)")
CACHE_ROOT = knobs.text("FTOPT_CACHE_DIR", "", "where the host checks' extension is "
                        "built (\"\": ~/.cache/ftopt)")


def enabled() -> bool:
    return ON


def _key() -> str:
    text = "\n".join([SOURCE, torch.__version__, str(torch.version.git_version),
                      sys.version, sysconfig.get_config_var("EXT_SUFFIX") or ""])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_dir() -> str:
    root = CACHE_ROOT or os.path.join(os.path.expanduser("~"), ".cache", "ftopt")
    return os.path.join(root, "native")


def _name() -> str:
    return f"ftopt_check_{_key()}"


def _path() -> str:
    return os.path.join(cache_dir(), _name() + (sysconfig.get_config_var("EXT_SUFFIX")
                                                or ".so"))


def missing() -> str | None:
    """What this machine lacks to build the extension (``None``: nothing)."""
    if compiler() is None:
        return "no C++ compiler (set CXX)"
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not os.path.exists(header):
        return f"no Python headers ({header}; install the python3-dev package)"
    if not os.path.isdir(os.path.join(os.path.dirname(torch.__file__), "include")):
        return "this torch ships no C++ headers"
    return None


def compiler() -> str | None:
    """The C++ compiler the build would use (``$CXX`` first), or ``None``."""
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def _build(path: str) -> None:
    compiler_path = compiler()
    if compiler_path is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    name = os.path.basename(path).split(".")[0]
    root = os.path.dirname(torch.__file__)
    lib = os.path.join(root, "lib")
    includes = [os.path.join(root, "include"),
                os.path.join(root, "include", "torch", "csrc", "api", "include"),
                sysconfig.get_paths()["include"]]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        src = os.path.join(tmp, name + ".cpp")
        with open(src, "w") as f:
            f.write(SOURCE.replace("MODULE_NAME", name))
        out = os.path.join(tmp, os.path.basename(path))
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        cmd = [compiler_path, "-O2", "-shared", "-fPIC", "-std=c++17", "-w", src, "-o", out,
               *[f"-I{d}" for d in includes], f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_python", "-ltorch", "-ltorch_cpu",
               "-lc10"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{os.path.basename(compiler_path)} failed: "
                               f"{done.stderr.strip()[-2000:]}")
        os.replace(out, path)  # atomic: another process may be building the same file


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_name(), path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_and_load() -> None:
    global _module, _state
    try:
        path = _path()
        if not os.path.exists(path):
            _build(path)
        module = _load(path)
    except Exception as e:  # noqa: BLE001 - any failure leaves the Python checks in use
        with _lock:
            _state = f"failed: {type(e).__name__}: {e}"
        return
    with _lock:
        _module, _state = module, "loaded"


def module(start: bool = True, wait: bool = False) -> ModuleType | None:
    """The extension if loaded. ``start``: load it now if it is built, else start building
    it in a background thread (once per process); ``wait``: block until that ends."""
    global _state, _thread
    if _module is not None or not start:
        return _module
    if not enabled():
        _state = "off (FTOPT_NATIVE=0)"
        return None
    load_now = False
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_build_and_load, name="ftopt-native",
                                       daemon=True)
            load_now = os.path.exists(_path())
            if not load_now:
                _state = "building"
                _thread.start()
        thread = _thread
    if load_now:
        _build_and_load()  # built by an earlier process: milliseconds
    elif wait and thread.is_alive():
        thread.join()
    return _module


def status() -> str:
    """``"loaded"``, ``"building"``, ``"not started"``, ``"off ..."`` or ``"failed: ..."``."""
    return _state
