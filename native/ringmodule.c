/*
 * overlord.shm._ring: thin CPython binding of ring.c.
 *
 * Python owns the mapping (an mmap object); a Handle holds one buffer export of it
 * for as long as it is open, so the memory cannot be unmapped under a C call.
 * Record payloads are returned as (offset, length) into that mapping; Python slices
 * its own memoryview, so no record byte is copied here. Waits and large copies
 * release the GIL. Status codes (ring.h) are returned, not raised, so the Python
 * side words the errors with the ring's name and pids.
 */
#include "ringhandle.h"

#include <limits.h>

static PyObject *mod_init_segment(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *obj;
    unsigned long long cap, pidns, start;
    int pid;
    if (!PyArg_ParseTuple(args, "OKiKK:init_segment", &obj, &cap, &pid, &pidns, &start)) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    int rc = ovl_ring_init(view.buf, (uint64_t)view.len, cap, pid, pidns, start);
    PyBuffer_Release(&view);
    return PyLong_FromLong(rc);
}

static PyObject *mod_check(PyObject *Py_UNUSED(m), PyObject *obj) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    int rc = ovl_ring_check(view.buf, (uint64_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromLong(rc);
}

static PyObject *mod_round_capacity(PyObject *Py_UNUSED(m), PyObject *arg) {
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(ovl_ring_round_capacity(n));
}

static PyObject *mod_segment_size(PyObject *Py_UNUSED(m), PyObject *arg) {
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(ovl_ring_segment_size(n));
}

/* wait_marks(handles, seen, timeout, poll): ovl_ring_wait_marks without the GIL; each
 * handle's mark. The handles are busy meanwhile: closing one raises, never unmaps. */
static PyObject *mod_wait_marks(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *handles, *seen, *limit_arg, *poll_arg;
    if (!PyArg_ParseTuple(args, "O!O!OO:wait_marks", &PyTuple_Type, &handles, &PyTuple_Type, &seen, &limit_arg,
                          &poll_arg)) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(handles);
    if (n > INT_MAX / 2 || PyTuple_GET_SIZE(seen) != n) {
        PyErr_SetString(PyExc_ValueError, "wait_marks: seen must hold one int a handle");
        return NULL;
    }
    int64_t limit_ns, poll_ns;
    if (!ovl_timeout_ns(limit_arg, &limit_ns) || !ovl_timeout_ns(poll_arg, &poll_ns)) {
        return NULL;
    }
    if (limit_ns < 0 || poll_ns <= 0) {
        PyErr_SetString(PyExc_ValueError, "wait_marks: timeout must be finite and poll > 0");
        return NULL;
    }
    HandleObject **hs = PyMem_Calloc((size_t)n + 1, sizeof(HandleObject *));
    ovl_ring **rings = PyMem_Calloc((size_t)n + 1, sizeof(ovl_ring *));
    uint64_t *want = PyMem_Calloc((size_t)n + 1, sizeof(uint64_t)), *now = PyMem_Calloc((size_t)n + 1, sizeof(uint64_t));
    PyObject *out = NULL;
    if (hs == NULL || rings == NULL || want == NULL || now == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyTuple_GET_ITEM(handles, i);
        if (!PyObject_TypeCheck(h, &ovl_HandleType)) {
            PyErr_SetString(PyExc_TypeError, "wait_marks: handles must be ring Handles");
            goto done;
        }
        hs[i] = (HandleObject *)h;
        if (!ovl_handle_ready(hs[i])) {
            goto done;
        }
        rings[i] = &hs[i]->ring;
        want[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(seen, i));
        if (PyErr_Occurred()) {
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        hs[i]->busy++;
    }
    Py_BEGIN_ALLOW_THREADS
    ovl_ring_wait_marks(rings, (int)n, want, now, limit_ns, poll_ns);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        hs[i]->busy--;
    }
    out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(now[i]);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
done:
    PyMem_Free(hs);
    PyMem_Free(rings);
    PyMem_Free(want);
    PyMem_Free(now);
    return out;
}

/* stream_copy(dst, src): ovl_stream_copy of a contiguous buffer into a writable one of
 * the same length, without the GIL when large. */
static PyObject *mod_stream_copy(PyObject *Py_UNUSED(m), PyObject *args) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*:stream_copy", &dst, &src)) {
        return NULL;
    }
    PyObject *out = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "stream_copy: %zd bytes into %zd", src.len, dst.len);
    } else {
        if (src.len >= GIL_RELEASE_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            ovl_stream_copy(dst.buf, src.buf, (size_t)src.len);
            Py_END_ALLOW_THREADS
        } else {
            ovl_stream_copy(dst.buf, src.buf, (size_t)src.len);
        }
        out = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return out;
}

static PyMethodDef module_methods[] = {
    {"stream_copy", mod_stream_copy, METH_VARARGS, "Copy into a record bypassing the cache (same lengths)."},
    {"init_segment", mod_init_segment, METH_VARARGS, "Initialise a zeroed mapping: status."},
    {"check", mod_check, METH_O, "Check a mapping's header: status."},
    {"round_capacity", mod_round_capacity, METH_O, "Capacity rounded to a power of two (0: too big)."},
    {"segment_size", mod_segment_size, METH_O, "Segment bytes for a capacity."},
    {"wait_marks", mod_wait_marks, METH_VARARGS, "Sleep until a consumer mark moves: each mark."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ringmodule = {
    PyModuleDef_HEAD_INIT, .m_name = "overlord.shm._ring",
    .m_doc = "Native protocol of the Overlord shared-memory ring (see native/ring.h).",
    .m_size = -1, .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__ring(void) {
    if (PyType_Ready(&ovl_HandleType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&ringmodule);
    if (m == NULL) {
        return NULL;
    }
    struct { const char *name; long long value; } consts[] = {
        {"OK", OVL_OK}, {"EAGAIN", OVL_EAGAIN}, {"ETIMEDOUT", OVL_ETIMEDOUT},
        {"ECLOSED", OVL_ECLOSED}, {"EERROR", OVL_EERROR}, {"ETOOBIG", OVL_ETOOBIG},
        {"ECORRUPT", OVL_ECORRUPT}, {"EUNINIT", OVL_EUNINIT}, {"EMAGIC", OVL_EMAGIC},
        {"EVERSION", OVL_EVERSION}, {"ESIZE", OVL_ESIZE}, {"ESTATE", OVL_ESTATE},
        {"HEADER_SIZE", OVL_RING_HEADER_SIZE}, {"RECORD_HEADER", OVL_RING_RECORD_HEADER},
        {"VERSION", OVL_RING_VERSION}, {"ERROR_BYTES", OVL_RING_ERROR_BYTES},
        {"MIN_CAPACITY", (long long)OVL_RING_MIN_CAPACITY},
        {"MAX_CAPACITY", (long long)OVL_RING_MAX_CAPACITY},
    };
    for (size_t i = 0; i < sizeof(consts) / sizeof(consts[0]); i++) {
        if (PyModule_AddIntConstant(m, consts[i].name, (long)consts[i].value) < 0) {
            goto fail;
        }
    }
    PyObject *magic = PyLong_FromUnsignedLongLong(OVL_RING_MAGIC);
    int added = magic != NULL && PyModule_AddObjectRef(m, "MAGIC", magic) == 0;
    Py_XDECREF(magic);
    if (!added) {
        goto fail;
    }
    if (PyModule_AddObjectRef(m, "Handle", (PyObject *)&ovl_HandleType) < 0) {
        goto fail;
    }
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
