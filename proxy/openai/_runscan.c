/*
 * proxy.openai._runscan: the native half of proxy.openai.chunkrun.
 *
 * scan(region, start, end, prefix, suffix) walks region[start:end] event by
 * event: each must be prefix + literal + suffix, where the literal holds no
 * newline and is a whole JSON string body (no bare `"`, every escape complete
 * and valid). It returns (events, the literals joined, empty literals), or
 * None at the first event that is anything else. The same verdict as
 * chunkrun's pure-Python cut (tests/unit/test_runscan.py compares the two on
 * generated and mutated regions), in one pass of memcmp/memchr over the
 * region and a copy of the literals, with no object per event.
 *
 * Built by setup.py as an optional extension: where no C compiler exists the
 * pure-Python cut is used. RUNSCAN_ABI is checked on import; bump it with any
 * change of what scan() returns.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define RUNSCAN_ABI 1

static int
is_hex(unsigned char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* A whole JSON string body: no bare quote, escapes complete and valid. */
static int
whole_literal(const unsigned char *q, const unsigned char *b)
{
    while (q < b) {
        unsigned char c = *q;
        if (c == '"') {
            return 0;
        }
        if (c != '\\') {
            q++;
            continue;
        }
        if (b - q < 2) {
            return 0;
        }
        c = q[1];
        if (c == 'u') {
            if (b - q < 6 || !is_hex(q[2]) || !is_hex(q[3]) || !is_hex(q[4]) || !is_hex(q[5])) {
                return 0;
            }
            q += 6;
        }
        else if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' ||
                 c == 'r' || c == 't') {
            q += 2;
        }
        else {
            return 0;
        }
    }
    return 1;
}

static PyObject *
scan(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "scan(region, start, end, prefix, suffix)");
        return NULL;
    }
    PyObject *region = args[0], *prefix = args[3], *suffix = args[4];
    if (!PyBytes_CheckExact(region) || !PyBytes_CheckExact(prefix) ||
        !PyBytes_CheckExact(suffix)) {
        PyErr_SetString(PyExc_TypeError, "scan: region, prefix and suffix must be bytes");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t end = PyLong_AsSsize_t(args[2]);
    if (end == -1 && PyErr_Occurred()) {
        return NULL;
    }
    const unsigned char *r = (const unsigned char *)PyBytes_AS_STRING(region);
    const unsigned char *pre = (const unsigned char *)PyBytes_AS_STRING(prefix);
    const unsigned char *suf = (const unsigned char *)PyBytes_AS_STRING(suffix);
    Py_ssize_t n = PyBytes_GET_SIZE(region);
    Py_ssize_t lp = PyBytes_GET_SIZE(prefix), ls = PyBytes_GET_SIZE(suffix);
    /* The envelope chunkrun learns: one data line, the suffix ends the line
     * and holds the blank line after it. */
    if (start < 0 || end > n || start > end || lp < 1 || ls < 2 || suf[ls - 1] != '\n' ||
        suf[ls - 2] != '\n' || memchr(pre, '\n', (size_t)lp) != NULL ||
        memchr(suf, '\n', (size_t)(ls - 2)) != NULL) {
        PyErr_SetString(PyExc_ValueError, "scan: not a one-line envelope or bad bounds");
        return NULL;
    }

    Py_ssize_t cap = 4096, len = 0, count = 0, empties = 0;
    PyObject *out = PyBytes_FromStringAndSize(NULL, cap);
    if (out == NULL) {
        return NULL;
    }
    const unsigned char *p = r + start, *stop = r + end;
    while (p < stop) {
        if (stop - p < lp + ls || memcmp(p, pre, (size_t)lp) != 0) {
            goto not_a_run;
        }
        const unsigned char *a = p + lp;
        const unsigned char *nl = memchr(a, '\n', (size_t)(stop - a));
        if (nl == NULL) {
            goto not_a_run;
        }
        /* The suffix starts ls - 2 bytes before the newline: compared as
         * offsets first, so that no pointer is formed before the literal
         * (one before the region's buffer would be undefined behaviour). */
        if (nl - a < ls - 2 || stop - nl < 2) {
            goto not_a_run;
        }
        const unsigned char *b = nl - (ls - 2); /* where the suffix starts */
        if (memcmp(b, suf, (size_t)ls) != 0 || !whole_literal(a, b)) {
            goto not_a_run;
        }
        Py_ssize_t m = b - a;
        if (m == 0) {
            empties++;
        }
        else {
            if (len + m > cap) {
                while (len + m > cap) {
                    cap *= 2;
                }
                if (_PyBytes_Resize(&out, cap) < 0) {
                    return NULL;
                }
            }
            memcpy(PyBytes_AS_STRING(out) + len, a, (size_t)m);
            len += m;
        }
        count++;
        p = b + ls;
    }
    if (_PyBytes_Resize(&out, len) < 0) {
        return NULL;
    }
    return Py_BuildValue("(nNn)", count, out, empties);

not_a_run:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

static PyMethodDef runscan_methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(region, start, end, prefix, suffix) -> (events, literals, empties) | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef runscan_module = {
    PyModuleDef_HEAD_INIT, "_runscan",
    "Runs of envelope chunks, scanned in C (proxy.openai.chunkrun).", -1, runscan_methods,
};

PyMODINIT_FUNC
PyInit__runscan(void)
{
    PyObject *m = PyModule_Create(&runscan_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ABI", RUNSCAN_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
