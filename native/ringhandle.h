/*
 * The ring Handle type of overlord.shm._ring (ringhandle.c), shared with the module's
 * functions and its init (ringmodule.c).
 */
#ifndef OVL_RINGHANDLE_H
#define OVL_RINGHANDLE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "ring.h"

/* Below this a copy is faster than the GIL round trip. */
#define GIL_RELEASE_BYTES (64 * 1024)

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int open;
    int busy; /* calls running without the GIL; close() must not unmap under them */
    ovl_ring ring;
} HandleObject;

extern PyTypeObject ovl_HandleType;

/* 1 if the handle is open; else 0 with ValueError set. */
int ovl_handle_ready(HandleObject *self);

/* Seconds (a Python number) as nanoseconds in *out, -1 for no limit (negative or
 * infinite); 0 with an exception set if it is not a number or NaN. */
int ovl_timeout_ns(PyObject *arg, int64_t *out);

#endif
