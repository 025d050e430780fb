/*
 * overlord.plan.balance._native: thin CPython binding of balance.c.
 *
 * Arguments are buffers (numpy arrays) that Python has already checked and shaped
 * (overlord/plan/balance/_kk.py, _greedy.py, _refine.py); this layer only checks each
 * buffer's byte length against the counts, so a wrong call fails with ValueError
 * instead of reading past an array. The kernels run without the GIL: they touch no
 * Python object, and the buffers are held for the call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>

#include "balance.h"

static int need(Py_buffer *b, const char *name, Py_ssize_t count, Py_ssize_t itemsize, int writable) {
    if (writable && b->readonly) {
        PyErr_Format(PyExc_ValueError, "%s must be writable", name);
        return 0;
    }
    if (b->len != count * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes; need %zd", name, b->len, count * itemsize);
        return 0;
    }
    return 1;
}

static PyObject *done(int rc) {
    if (rc == OVL_BAL_ENOMEM) {
        return PyErr_NoMemory();
    }
    Py_RETURN_NONE;
}

static PyObject *mod_cost_order(PyObject *Py_UNUSED(m), PyObject *args) {
    Py_buffer costs, out;
    int descending;
    if (!PyArg_ParseTuple(args, "y*pw*:cost_order", &costs, &descending, &out)) {
        return NULL;
    }
    Py_ssize_t n = costs.len / 8;
    int rc = 0;
    if (need(&costs, "costs", n, 8, 0) && need(&out, "out", n, 8, 1)) {
        Py_BEGIN_ALLOW_THREADS;
        rc = ovl_bal_cost_order(costs.buf, n, descending, out.buf);
        Py_END_ALLOW_THREADS;
    }
    PyBuffer_Release(&costs);
    PyBuffer_Release(&out);
    return PyErr_Occurred() ? NULL : done(rc);
}

static PyObject *mod_differencing(PyObject *Py_UNUSED(m), PyObject *args) {
    Py_buffer vals, out;
    Py_ssize_t k;
    int equal_count;
    if (!PyArg_ParseTuple(args, "y*npw*:differencing", &vals, &k, &equal_count, &out)) {
        return NULL;
    }
    Py_ssize_t n = vals.len / 8;
    int rc = 0;
    if (k >= 1 && need(&vals, "vals", n, 8, 0) && need(&out, "out", n, 8, 1)) {
        Py_BEGIN_ALLOW_THREADS;
        rc = ovl_bal_differencing(vals.buf, n, k, equal_count, out.buf);
        Py_END_ALLOW_THREADS;
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "k must be >= 1");
    }
    PyBuffer_Release(&vals);
    PyBuffer_Release(&out);
    return PyErr_Occurred() ? NULL : done(rc);
}

static PyObject *mod_greedy_groups(PyObject *Py_UNUSED(m), PyObject *args) {
    Py_buffer costs, sizes = {0}, order, start, out;
    PyObject *sizes_obj;
    double capacity;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "y*Ody*y*nw*:greedy_groups", &costs, &sizes_obj, &capacity, &order, &start, &k,
                          &out)) {
        return NULL;
    }
    Py_ssize_t n = costs.len / 8, groups = start.len / 8 - 1;
    int have_sizes = sizes_obj != Py_None, rc = 0;
    if (have_sizes && PyObject_GetBuffer(sizes_obj, &sizes, PyBUF_C_CONTIGUOUS) < 0) {
        have_sizes = 0;
    } else if (k < 1 || groups < 0) {
        PyErr_SetString(PyExc_ValueError, "need k >= 1 and at least one group start");
    } else if (need(&costs, "costs", n, 8, 0) && (!have_sizes || need(&sizes, "sizes", n, 8, 0)) &&
               need(&out, "out", n, 8, 1) && need(&order, "order", order.len / 8, 8, 0)) {
        const int64_t *st = start.buf;
        Py_ssize_t n_order = order.len / 8;
        int ok = groups == 0 || (st[0] == 0 && st[groups] <= n_order);
        for (Py_ssize_t g = 0; ok && g < groups; g++) {
            ok = st[g] <= st[g + 1];
        }
        const int64_t *ord = order.buf;
        for (Py_ssize_t p = 0; ok && p < n_order; p++) {
            ok = ord[p] >= 0 && ord[p] < n;
        }
        if (!ok) {
            PyErr_SetString(PyExc_ValueError, "start must rise from 0 within order, and order index costs");
        } else {
            Py_BEGIN_ALLOW_THREADS;
            rc = ovl_bal_greedy_groups(costs.buf, have_sizes ? sizes.buf : NULL, capacity, order.buf, start.buf,
                                       groups, k, out.buf);
            Py_END_ALLOW_THREADS;
        }
    }
    if (have_sizes) {
        PyBuffer_Release(&sizes);
    }
    PyBuffer_Release(&costs);
    PyBuffer_Release(&order);
    PyBuffer_Release(&start);
    PyBuffer_Release(&out);
    return PyErr_Occurred() ? NULL : done(rc);
}

static PyObject *mod_bin_table(PyObject *Py_UNUSED(m), PyObject *args) {
    Py_buffer bin, costs, table, loads;
    Py_ssize_t k, m;
    if (!PyArg_ParseTuple(args, "y*y*nnw*w*:bin_table", &bin, &costs, &k, &m, &table, &loads)) {
        return NULL;
    }
    Py_ssize_t n = bin.len / 8;
    int rc = 0;
    if (k < 1 || m < 0) {
        PyErr_SetString(PyExc_ValueError, "need k >= 1 and m >= 0");
    } else if (need(&bin, "bin", n, 8, 0) && need(&costs, "costs", n, 8, 0) && need(&table, "table", k * m, 8, 1) &&
               need(&loads, "loads", k, 8, 1)) {
        /* every bin in [-1, k) and none over m members, or the table would be overrun */
        const int64_t *b = bin.buf;
        int64_t *cnt = calloc((size_t)k, sizeof *cnt);
        int ok = cnt != NULL;
        for (Py_ssize_t i = 0; ok && i < n; i++) {
            ok = b[i] >= -1 && b[i] < k && (b[i] < 0 || ++cnt[b[i]] <= m);
        }
        free(cnt);
        if (!ok) {
            PyErr_SetString(PyExc_ValueError, "bins must be in [-1, k) with at most m items each");
        } else {
            Py_BEGIN_ALLOW_THREADS;
            rc = ovl_bal_bin_table(bin.buf, costs.buf, n, k, m, table.buf, loads.buf);
            Py_END_ALLOW_THREADS;
        }
    }
    PyBuffer_Release(&bin);
    PyBuffer_Release(&costs);
    PyBuffer_Release(&table);
    PyBuffer_Release(&loads);
    return PyErr_Occurred() ? NULL : done(rc);
}

static PyObject *mod_refine_pairs(PyObject *Py_UNUSED(m), PyObject *args) {
    Py_buffer cn, cz, table, loads, out;
    Py_ssize_t k, m, max_swaps;
    double stop, scale;
    if (!PyArg_ParseTuple(args, "y*y*w*nnw*ddnw*:refine_pairs", &cn, &cz, &table, &k, &m, &loads, &stop, &scale,
                          &max_swaps, &out)) {
        return NULL;
    }
    Py_ssize_t n = cn.len / 8 - 1;
    int rc = 0;
    if (n < 0 || k < 1 || m < 1) {
        PyErr_SetString(PyExc_ValueError, "need n >= 0, k >= 1 and m >= 1");
    } else if (need(&cz, "cz", n + 1, 8, 0) && need(&table, "table", k * m, 8, 1) && need(&loads, "loads", k, 8, 1) &&
               need(&out, "out", n, 8, 1)) {
        const int64_t *t = table.buf;
        int ok = 1;
        for (Py_ssize_t j = 0; ok && j < k * m; j++) {
            ok = t[j] >= -1 && t[j] < n;
        }
        if (!ok) {
            PyErr_SetString(PyExc_ValueError, "table entries must be item indices or -1");
        } else {
            Py_BEGIN_ALLOW_THREADS;
            rc = ovl_bal_refine_pairs(cn.buf, cz.buf, n, table.buf, k, m, loads.buf, stop, scale, max_swaps,
                                      out.buf);
            Py_END_ALLOW_THREADS;
        }
    }
    PyBuffer_Release(&cn);
    PyBuffer_Release(&cz);
    PyBuffer_Release(&table);
    PyBuffer_Release(&loads);
    PyBuffer_Release(&out);
    return PyErr_Occurred() ? NULL : done(rc);
}

static PyObject *mod_two_level(PyObject *Py_UNUSED(m), PyObject *args) {
    Py_buffer costs, bucket, mbin;
    Py_ssize_t buckets, bins;
    double tol;
    if (!PyArg_ParseTuple(args, "y*nndw*w*:two_level", &costs, &buckets, &bins, &tol, &bucket, &mbin)) {
        return NULL;
    }
    Py_ssize_t n = costs.len / 8;
    int rc = 0;
    if (n < 1 || buckets < 1 || bins < 1) {
        PyErr_SetString(PyExc_ValueError, "need at least one cost, bucket and bin");
    } else if (need(&costs, "costs", n, 8, 0) && need(&bucket, "bucket", n, 8, 1) && need(&mbin, "mbin", n, 8, 1)) {
        const double *c = costs.buf;
        int ok = 1;
        for (Py_ssize_t i = 0; ok && i < n; i++) {
            ok = c[i] >= 0.0 && c[i] <= DBL_MAX; /* false for NaN too */
        }
        if (!ok) {
            PyErr_SetString(PyExc_ValueError, "costs must be finite and >= 0");
        } else {
            Py_BEGIN_ALLOW_THREADS;
            rc = ovl_bal_two_level(c, n, buckets, bins, tol, bucket.buf, mbin.buf);
            Py_END_ALLOW_THREADS;
        }
    }
    PyBuffer_Release(&costs);
    PyBuffer_Release(&bucket);
    PyBuffer_Release(&mbin);
    return PyErr_Occurred() ? NULL : done(rc);
}

static PyObject *mod_same_once(PyObject *Py_UNUSED(m), PyObject *args) {
    Py_buffer given, wanted;
    if (!PyArg_ParseTuple(args, "y*y*:same_once", &given, &wanted)) {
        return NULL;
    }
    int rc = 0;
    if (given.len % 24 || wanted.len % 24) {
        PyErr_SetString(PyExc_ValueError, "given and wanted must hold whole rows of three int64");
    } else {
        Py_BEGIN_ALLOW_THREADS;
        rc = ovl_plan_same_once(given.buf, given.len / 24, wanted.buf, wanted.len / 24);
        Py_END_ALLOW_THREADS;
    }
    PyBuffer_Release(&given);
    PyBuffer_Release(&wanted);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (rc == OVL_BAL_ENOMEM) {
        return PyErr_NoMemory();
    }
    return PyBool_FromLong(rc);
}

static PyMethodDef methods[] = {
    {"cost_order", mod_cost_order, METH_VARARGS, "cost_order(costs, descending, out): stable order into out."},
    {"differencing", mod_differencing, METH_VARARGS, "differencing(vals, k, equal_count, out): bins into out."},
    {"greedy_groups", mod_greedy_groups, METH_VARARGS,
     "greedy_groups(costs, sizes|None, capacity, order, start, k, out): bins into out."},
    {"bin_table", mod_bin_table, METH_VARARGS, "bin_table(bin, costs, k, m, table, loads): members and loads."},
    {"refine_pairs", mod_refine_pairs, METH_VARARGS,
     "refine_pairs(cn, cz, table, k, m, loads, stop, scale, max_swaps, out): swaps in place."},
    {"two_level", mod_two_level, METH_VARARGS,
     "two_level(costs, buckets, bins, tol, bucket, mbin): assign()'s defaults, bins into bucket and mbin."},
    {"same_once", mod_same_once, METH_VARARGS,
     "same_once(given, wanted): whether the int64 rows of three in given are those of wanted, each once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "overlord.plan.balance._native", "Balancing kernels (native/balance.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
