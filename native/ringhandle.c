/*
 * overlord.shm._ring.Handle: a process-local handle on a mapped ring (ring.c), one
 * producer or consumer side. See ringmodule.c for how the binding owns its memory.
 */
#include "ringhandle.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int ovl_handle_ready(HandleObject *self) {
    if (!self->open) {
        PyErr_SetString(PyExc_ValueError, "ring handle is closed");
        return 0;
    }
    return 1;
}

int ovl_timeout_ns(PyObject *arg, int64_t *out) {
    double s = PyFloat_AsDouble(arg);
    if (s == -1.0 && PyErr_Occurred()) {
        return 0;
    }
    if (s != s) {
        PyErr_SetString(PyExc_ValueError, "timeout is NaN");
        return 0;
    }
    /* Negative or infinite: wait without limit (the Python side slices waits anyway). */
    *out = (s < 0 || s > 1e9) ? -1 : (int64_t)(s * 1e9);
    return 1;
}

static int Handle_init(HandleObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buffer", NULL};
    PyObject *obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Handle", kwlist, &obj)) {
        return -1;
    }
    if (self->open) {
        PyErr_SetString(PyExc_ValueError, "Handle already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    int rc = ovl_ring_open(&self->ring, self->view.buf, (uint64_t)self->view.len);
    if (rc != OVL_OK) {
        PyBuffer_Release(&self->view);
        PyErr_Format(PyExc_ValueError, "not a usable ring mapping (status %d)", rc);
        return -1;
    }
    self->open = 1;
    return 0;
}

static void Handle_dealloc(HandleObject *self) {
    if (self->open) {
        PyBuffer_Release(&self->view);
        self->open = 0;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Handle_close(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->busy) {
        PyErr_SetString(PyExc_BufferError, "ring handle is in use by another thread");
        return NULL;
    }
    if (self->open) {
        PyBuffer_Release(&self->view);
        self->open = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *Handle_try_reserve(HandleObject *self, PyObject *arg) {
    unsigned long long len = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred() || !ovl_handle_ready(self)) {
        return NULL;
    }
    uint64_t off = 0;
    int rc = ovl_ring_try_reserve(&self->ring, len, &off);
    /* >= 0: payload offset; < 0: minus a status code. One int keeps the hot path cheap. */
    return PyLong_FromLongLong(rc == OVL_OK ? (long long)off : -(long long)rc);
}

static PyObject *Handle_wait_space(HandleObject *self, PyObject *args) {
    unsigned long long len;
    PyObject *t;
    int64_t ns;
    if (!PyArg_ParseTuple(args, "KO:wait_space", &len, &t) || !ovl_timeout_ns(t, &ns) ||
        !ovl_handle_ready(self)) {
        return NULL;
    }
    int rc;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    rc = ovl_ring_wait_space(&self->ring, len, ns);
    Py_END_ALLOW_THREADS
    self->busy--;
    return PyBool_FromLong(rc == OVL_OK);
}

static PyObject *Handle_commit(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!ovl_handle_ready(self)) {
        return NULL;
    }
    return PyLong_FromLong(ovl_ring_commit(&self->ring));
}

static PyObject *Handle_commit_quiet(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!ovl_handle_ready(self)) {
        return NULL;
    }
    return PyLong_FromLong(ovl_ring_commit_quiet(&self->ring));
}

static PyObject *Handle_wake_data(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!ovl_handle_ready(self)) {
        return NULL;
    }
    ovl_ring_wake_data(&self->ring);
    Py_RETURN_NONE;
}

static PyObject *Handle_abort(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!ovl_handle_ready(self)) {
        return NULL;
    }
    ovl_ring_abort(&self->ring);
    Py_RETURN_NONE;
}

static PyObject *Handle_copy_into(HandleObject *self, PyObject *args) {
    unsigned long long off;
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "Ky*:copy_into", &off, &src)) {
        return NULL;
    }
    if (!ovl_handle_ready(self)) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (off > (unsigned long long)self->view.len || (unsigned long long)src.len > self->view.len - off) {
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_IndexError, "copy_into: range outside the ring mapping");
        return NULL;
    }
    char *dst = (char *)self->view.buf + off;
    if (src.len >= GIL_RELEASE_BYTES) {
        self->busy++;
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
        self->busy--;
    } else {
        memcpy(dst, src.buf, (size_t)src.len);
    }
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyObject *Handle_close_writer(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!ovl_handle_ready(self)) {
        return NULL;
    }
    ovl_ring_close_writer(&self->ring);
    Py_RETURN_NONE;
}

static PyObject *Handle_try_read(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!ovl_handle_ready(self)) {
        return NULL;
    }
    uint64_t off = 0, len = 0;
    int rc = ovl_ring_try_read(&self->ring, &off, &len);
    return Py_BuildValue("(iKK)", rc, (unsigned long long)off, (unsigned long long)len);
}

static PyObject *Handle_wait_data(HandleObject *self, PyObject *arg) {
    int64_t ns;
    if (!ovl_timeout_ns(arg, &ns) || !ovl_handle_ready(self)) {
        return NULL;
    }
    int rc;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    rc = ovl_ring_wait_data(&self->ring, ns);
    Py_END_ALLOW_THREADS
    self->busy--;
    return PyBool_FromLong(rc == OVL_OK);
}

static PyObject *Handle_release(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!ovl_handle_ready(self)) {
        return NULL;
    }
    return PyBool_FromLong(ovl_ring_release(&self->ring) == OVL_OK);
}

static PyObject *Handle_peek(HandleObject *self, PyObject *arg) {
    unsigned long long cursor = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred() || !ovl_handle_ready(self)) {
        return NULL;
    }
    uint64_t off = 0, len = 0, next = cursor;
    int rc = ovl_ring_peek(&self->ring, cursor, &off, &len, &next);
    return Py_BuildValue("(iKKK)", rc, (unsigned long long)off, (unsigned long long)len, (unsigned long long)next);
}

static PyObject *Handle_wait_data_at(HandleObject *self, PyObject *args) {
    unsigned long long cursor;
    int holding;
    PyObject *t;
    int64_t ns;
    if (!PyArg_ParseTuple(args, "KpO:wait_data_at", &cursor, &holding, &t) || !ovl_timeout_ns(t, &ns) ||
        !ovl_handle_ready(self)) {
        return NULL;
    }
    int rc;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    rc = ovl_ring_wait_data_at(&self->ring, cursor, holding, ns);
    Py_END_ALLOW_THREADS
    self->busy--;
    return PyBool_FromLong(rc == OVL_OK);
}

static PyObject *Handle_release_to(HandleObject *self, PyObject *arg) {
    unsigned long long tail = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred() || !ovl_handle_ready(self)) {
        return NULL;
    }
    return PyBool_FromLong(ovl_ring_release_to(&self->ring, tail) == OVL_OK);
}

static PyObject *Handle_set_mark(HandleObject *self, PyObject *arg) {
    unsigned long long mark = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred() || !ovl_handle_ready(self)) {
        return NULL;
    }
    ovl_ring_set_mark(&self->ring, mark);
    Py_RETURN_NONE;
}

/* Give the pages under [offset, offset + length) of this process's mapping a private
 * copy of their bytes (anonymous memory at the same address), so whatever points there
 * keeps its bytes after the ring reuses the space. The caller must not read later
 * records through this mapping: it maps the segment again. False when the range would
 * touch the header page (pages larger than the header) or the mapping's ends. */
static PyObject *Handle_detach(HandleObject *self, PyObject *args) {
    unsigned long long off, len;
    if (!PyArg_ParseTuple(args, "KK:detach", &off, &len) || !ovl_handle_ready(self)) {
        return NULL;
    }
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t base = (uintptr_t)self->view.buf;
    uintptr_t start = (base + (uintptr_t)off) & ~(page - 1);
    uintptr_t end = (base + (uintptr_t)off + (uintptr_t)len + page - 1) & ~(page - 1);
    if (len == 0 || off > (unsigned long long)self->view.len || len > self->view.len - off ||
        start < base + OVL_RING_HEADER_SIZE || end > base + (uintptr_t)self->view.len || (base & (page - 1)) != 0) {
        Py_RETURN_FALSE;
    }
    size_t n = (size_t)(end - start);
    void *copy = malloc(n);
    if (copy == NULL) {
        return PyErr_NoMemory();
    }
    memcpy(copy, (void *)start, n);
    void *got = mmap((void *)start, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (got == MAP_FAILED) {
        free(copy);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    memcpy((void *)start, copy, n);
    free(copy);
    Py_RETURN_TRUE;
}

static PyObject *Handle_set_error(HandleObject *self, PyObject *arg) {
    Py_buffer msg;
    if (PyObject_GetBuffer(arg, &msg, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (!ovl_handle_ready(self)) {
        PyBuffer_Release(&msg);
        return NULL;
    }
    int rc = ovl_ring_set_error(&self->ring, (const char *)msg.buf, (uint64_t)msg.len);
    PyBuffer_Release(&msg);
    return PyBool_FromLong(rc == OVL_OK);
}

static PyObject *Handle_set_pid(HandleObject *self, PyObject *args) {
    int consumer;
    int pid;
    unsigned long long pidns;
    if (!PyArg_ParseTuple(args, "piK:set_pid", &consumer, &pid, &pidns) || !ovl_handle_ready(self)) {
        return NULL;
    }
    ovl_ring_header *h = self->ring.hdr;
    /* Namespace first: a peer that sees the pid must also see where it is valid. */
    atomic_store_explicit(consumer ? &h->consumer_pidns : &h->producer_pidns, pidns, memory_order_release);
    atomic_store_explicit(consumer ? &h->consumer_pid : &h->producer_pid, pid, memory_order_release);
    Py_RETURN_NONE;
}

static PyObject *Handle_get_error(HandleObject *self, void *Py_UNUSED(closure)) {
    if (!ovl_handle_ready(self)) {
        return NULL;
    }
    const char *msg = NULL;
    int64_t len = ovl_ring_get_error(&self->ring, &msg);
    if (len < 0) {
        Py_RETURN_NONE;
    }
    return PyBytes_FromStringAndSize(msg, (Py_ssize_t)len);
}

/* Integer header fields, selected by closure so one getter serves them all. */
enum {
    F_CAPACITY, F_MAX_RECORD, F_CREATOR, F_PRODUCER, F_CONSUMER,
    F_CLOSED, F_PENDING, F_PRODUCER_NS, F_CONSUMER_NS, F_TAIL, F_SPACE_WANTED, F_MARK,
};

static PyObject *Handle_get_int(HandleObject *self, void *closure) {
    if (!ovl_handle_ready(self)) {
        return NULL;
    }
    ovl_ring *r = &self->ring;
    ovl_ring_header *h = r->hdr;
    switch ((int)(intptr_t)closure) {
    case F_CAPACITY:
        return PyLong_FromUnsignedLongLong(r->capacity);
    case F_MAX_RECORD:
        return PyLong_FromUnsignedLongLong(ovl_ring_max_record(r));
    case F_CREATOR:
        return PyLong_FromLong(h->creator_pid);
    case F_PRODUCER:
        return PyLong_FromLong(atomic_load_explicit(&h->producer_pid, memory_order_acquire));
    case F_CONSUMER:
        return PyLong_FromLong(atomic_load_explicit(&h->consumer_pid, memory_order_acquire));
    case F_CLOSED:
        return PyBool_FromLong(ovl_ring_is_closed(r));
    case F_PRODUCER_NS:
        return PyLong_FromUnsignedLongLong(atomic_load_explicit(&h->producer_pidns, memory_order_acquire));
    case F_CONSUMER_NS:
        return PyLong_FromUnsignedLongLong(atomic_load_explicit(&h->consumer_pidns, memory_order_acquire));
    case F_TAIL:
        return PyLong_FromUnsignedLongLong(ovl_ring_tail(r));
    case F_SPACE_WANTED:
        return PyBool_FromLong(ovl_ring_space_wanted(r));
    case F_MARK:
        return PyLong_FromUnsignedLongLong(atomic_load_explicit(&h->consumer_mark, memory_order_acquire));
    default:
        return PyLong_FromUnsignedLongLong(ovl_ring_pending(r));
    }
}

static PyMethodDef Handle_methods[] = {
    {"close", (PyCFunction)Handle_close, METH_NOARGS, "Release the buffer export."},
    {"try_reserve", (PyCFunction)Handle_try_reserve, METH_O, "Reserve a record: offset, or -status."},
    {"wait_space", (PyCFunction)Handle_wait_space, METH_VARARGS, "Sleep until space may be free."},
    {"commit", (PyCFunction)Handle_commit, METH_NOARGS, "Publish the reserved record: status."},
    {"commit_quiet", (PyCFunction)Handle_commit_quiet, METH_NOARGS, "Publish the reserved record, waking nobody: status."},
    {"wake_data", (PyCFunction)Handle_wake_data, METH_NOARGS, "Wake a consumer asleep on the ring."},
    {"abort", (PyCFunction)Handle_abort, METH_NOARGS, "Drop the reservation."},
    {"copy_into", (PyCFunction)Handle_copy_into, METH_VARARGS, "memcpy a buffer to an offset."},
    {"close_writer", (PyCFunction)Handle_close_writer, METH_NOARGS, "Mark end of stream."},
    {"try_read", (PyCFunction)Handle_try_read, METH_NOARGS, "(status, offset, length)."},
    {"wait_data", (PyCFunction)Handle_wait_data, METH_O, "Sleep until data may be ready."},
    {"release", (PyCFunction)Handle_release, METH_NOARGS, "Release the current record."},
    {"peek", (PyCFunction)Handle_peek, METH_O, "(status, offset, length, next cursor) at a cursor."},
    {"wait_data_at", (PyCFunction)Handle_wait_data_at, METH_VARARGS, "Sleep until data may be past a cursor."},
    {"release_to", (PyCFunction)Handle_release_to, METH_O, "Move tail forward to a cursor: ok."},
    {"set_mark", (PyCFunction)Handle_set_mark, METH_O, "Store the consumer's progress mark."},
    {"detach", (PyCFunction)Handle_detach, METH_VARARGS, "Privatise the pages under a range: ok."},
    {"set_error", (PyCFunction)Handle_set_error, METH_O, "Set the error slot (first wins)."},
    {"set_pid", (PyCFunction)Handle_set_pid, METH_VARARGS, "Record a claimant's pid and pid namespace."},
    {NULL, NULL, 0, NULL},
};

#define INT_GETTER(name, field) {name, (getter)Handle_get_int, NULL, NULL, (void *)(intptr_t)(field)}
static PyGetSetDef Handle_getset[] = {
    INT_GETTER("capacity", F_CAPACITY),
    INT_GETTER("max_record", F_MAX_RECORD),
    INT_GETTER("creator_pid", F_CREATOR),
    INT_GETTER("producer_pid", F_PRODUCER),
    INT_GETTER("consumer_pid", F_CONSUMER),
    INT_GETTER("closed", F_CLOSED),
    INT_GETTER("pending", F_PENDING),
    INT_GETTER("producer_pidns", F_PRODUCER_NS),
    INT_GETTER("consumer_pidns", F_CONSUMER_NS),
    INT_GETTER("tail", F_TAIL),
    INT_GETTER("space_wanted", F_SPACE_WANTED),
    INT_GETTER("consumer_mark", F_MARK),
    {"error", (getter)Handle_get_error, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject ovl_HandleType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "overlord.shm._ring.Handle",
    .tp_basicsize = sizeof(HandleObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Process-local handle on a mapped ring (one producer or consumer side).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Handle_init,
    .tp_dealloc = (destructor)Handle_dealloc,
    .tp_methods = Handle_methods,
    .tp_getset = Handle_getset,
};

