/* The kernel's fast loop in C (asyncdbo/_core/kernel.py, DBORun._loop_until_done).
 *
 * Why: while every ubatch keeps yielding SWITCH, the Python loop pays its own bytecode and the
 * functools.partial -> Context.run -> coroutine.send chain on every switch. With this loop and
 * the C primitives a switch went from 1.26-1.64x a bare Python coro.send trampoline to 0.73-0.90x
 * (benchmarks/switch_cost.py, N = 2, depth 2-16; results of 2026-11-29 run 6 and 2026-12-01 run 2).
 * This loop does the same steps:
 * pop the next ready ubatch, resume it inside its own context, push it back if it switched; and
 * it stops at anything the Python loop must decide (a park, a finish, an error, a pending timer
 * or wake-up), handing the ubatch and what happened back to it. Python stays the reference: the
 * kernel runs its Python loop where an instrument or an event-loop wait is involved, and under
 * ASYNCDBO_PURE_PYTHON=1.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

static PyTypeObject *g_ubatch_type;
static Py_ssize_t ub_resume, ub_send, ub_ctx, ub_coro, ub_resume_with;

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

/* What spin() reports; kernel.py has the same numbers. */
enum { SWITCHED = 0, PARKED = 1, FINISHED = 2, FAILED = 3, EMPTY = 4 };

static int
member_offset(PyTypeObject *tp, const char *name, Py_ssize_t *off)
{
    PyObject *d = PyObject_GetAttrString((PyObject *)tp, name);
    if (d == NULL)
        return -1;
    if (!Py_IS_TYPE(d, &PyMemberDescr_Type) || ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not an object __slots__ field", tp->tp_name, name);
        Py_DECREF(d);
        return -1;
    }
    *off = ((PyMemberDescrObject *)d)->d_member->offset;
    Py_DECREF(d);
    return 0;
}

static PyObject *
report(Py_ssize_t n, PyObject *ub, int status, PyObject *value)
{
    /* steals ub and value */
    PyObject *r = Py_BuildValue("(nOiO)", n, ub, status, value);
    Py_DECREF(ub);
    Py_DECREF(value);
    return r;
}

/* The error just raised, as an exception object with its traceback. */
static PyObject *
fetch_error(void)
{
    PyObject *typ, *val, *tb;
    PyErr_Fetch(&typ, &val, &tb);
    PyErr_NormalizeException(&typ, &val, &tb);
    if (tb != NULL)
        PyException_SetTraceback(val, tb);
    Py_XDECREF(typ);
    Py_XDECREF(tb);
    return val;
}

/* spin(pop, push, woken, timers, switch, install) -> (switches, ubatch, status, value)
 *
 * Resume ubatches in ring order while each yields `switch`, counting the switches; before each
 * resume, `install(ubatch.resume_with)` unless `install` is None (the run's install, which does
 * nothing when that stream is current already; an error from it propagates, as from the Python
 * loop). Returns when
 * a ubatch does anything else: PARKED (value: what it yielded), FINISHED (value: its result),
 * FAILED (value: the exception, not raised); or when it switched and `timers` (a list) or `woken`
 * (a deque, or None to ignore it) is not empty: SWITCHED, the ubatch not pushed back yet. EMPTY
 * when the ring is empty. */
static PyObject *
spin(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "spin() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *pop = args[0], *push = args[1], *woken = args[2], *timers = args[3], *switch_ = args[4];
    PyObject *install = args[5] == Py_None ? NULL : args[5];
    if (g_ubatch_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "asyncdbo._core._spin.configure() was not called");
        return NULL;
    }
    if (!PyList_CheckExact(timers)) {
        PyErr_SetString(PyExc_TypeError, "spin(): timers must be a list");
        return NULL;
    }
    if (woken == Py_None)
        woken = NULL;
    Py_ssize_t n = 0;
    for (;;) {
        PyObject *ub = PyObject_CallNoArgs(pop);
        if (ub == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_IndexError))
                return NULL;
            PyErr_Clear();
            return report(n, Py_NewRef(Py_None), EMPTY, Py_NewRef(Py_None));
        }
        /* An exact UBatch is read at its slots; a subclass (asyncdbo.testing's tag logger) through
         * its attributes, which it may override. */
        int exact = Py_IS_TYPE(ub, g_ubatch_type);
        if (install != NULL) {
            PyObject *with = exact ? Py_XNewRef(SLOT(ub, ub_resume_with)) : PyObject_GetAttrString(ub, "resume_with");
            PyObject *r = with == NULL ? NULL : PyObject_CallOneArg(install, with);
            Py_XDECREF(with);
            if (r == NULL) {
                Py_DECREF(ub);
                return NULL;
            }
            Py_DECREF(r);
        }
        PyObject *resume = exact ? Py_XNewRef(SLOT(ub, ub_resume)) : PyObject_GetAttrString(ub, "resume");
        PyObject *result = NULL;
        int status;
        if (resume == NULL && !exact)
            return report(n, ub, FAILED, fetch_error());
        if (exact && resume != NULL && resume == SLOT(ub, ub_send)) { /* ctx.run(coro.send, None), inlined */
            Py_DECREF(resume);
            /* held for the call: nothing the ubatch runs may free them under us */
            PyObject *ctx = Py_XNewRef(SLOT(ub, ub_ctx)), *coro = Py_XNewRef(SLOT(ub, ub_coro));
            if (ctx == NULL || coro == NULL || PyContext_Enter(ctx) < 0) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_RuntimeError, "spin(): ubatch %R has no context or coroutine", ub);
                Py_XDECREF(ctx);
                Py_XDECREF(coro);
                return report(n, ub, FAILED, fetch_error());
            }
            PySendResult r = PyIter_Send(coro, Py_None, &result);
            int exited = PyContext_Exit(ctx);
            Py_DECREF(ctx);
            Py_DECREF(coro);
            if (exited < 0) {
                Py_XDECREF(result);
                return report(n, ub, FAILED, fetch_error());
            }
            status = r == PYGEN_NEXT ? PARKED : r == PYGEN_RETURN ? FINISHED : FAILED;
        }
        else { /* a one-shot throw (a cancellation), or a resume set by hand */
            result = resume == NULL ? NULL : PyObject_CallNoArgs(resume);
            Py_XDECREF(resume);
            status = PARKED;
            if (result == NULL) {
                if (resume == NULL)
                    PyErr_Format(PyExc_RuntimeError, "spin(): ubatch %R has no resume", ub);
                if (PyErr_ExceptionMatches(PyExc_StopIteration)) {
                    PyObject *stop = fetch_error();
                    result = PyObject_GetAttrString(stop, "value");
                    Py_DECREF(stop);
                    if (result == NULL)
                        return report(n, ub, FAILED, fetch_error());
                    status = FINISHED;
                }
                else
                    status = FAILED;
            }
        }
        if (status == FAILED)
            return report(n, ub, FAILED, fetch_error());
        if (status == FINISHED)
            return report(n, ub, FINISHED, result);
        if (result != switch_)
            return report(n, ub, PARKED, result);
        Py_DECREF(result);
        n++;
        if (PyList_GET_SIZE(timers) > 0 || (woken != NULL && PyObject_Length(woken) > 0))
            return report(n, ub, SWITCHED, Py_NewRef(Py_None));
        PyObject *r = PyObject_CallOneArg(push, ub);
        Py_DECREF(ub);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
}

static PyObject *
configure(PyObject *Py_UNUSED(module), PyObject *tp)
{
    if (!PyType_Check(tp)) {
        PyErr_Format(PyExc_TypeError, "configure() needs the UBatch type (got %R)", tp);
        return NULL;
    }
    PyTypeObject *t = (PyTypeObject *)tp;
    if (member_offset(t, "resume", &ub_resume) || member_offset(t, "send", &ub_send)
        || member_offset(t, "ctx", &ub_ctx) || member_offset(t, "coro", &ub_coro)
        || member_offset(t, "resume_with", &ub_resume_with))
        return NULL;
    Py_XSETREF(g_ubatch_type, (PyTypeObject *)Py_NewRef(tp));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"spin", (PyCFunction)(void (*)(void))spin, METH_FASTCALL,
     "spin(pop, push, woken, timers, switch, install) -> (switches, ubatch, status, value): the kernel's fast loop."},
    {"configure", configure, METH_O, "configure(UBatch): the record whose slots spin() reads."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef spin_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "asyncdbo._core._spin",
    .m_doc = "The kernel's fast loop in C; asyncdbo._core.kernel is the reference.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__spin(void)
{
    PyObject *m = PyModule_Create(&spin_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "SWITCHED", SWITCHED) || PyModule_AddIntConstant(m, "PARKED", PARKED)
        || PyModule_AddIntConstant(m, "FINISHED", FINISHED) || PyModule_AddIntConstant(m, "FAILED", FAILED)
        || PyModule_AddIntConstant(m, "EMPTY", EMPTY)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
