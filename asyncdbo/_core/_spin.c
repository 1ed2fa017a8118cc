/* The kernel's fast loop in C (asyncdbo/_core/kernel.py, DBORun._loop_until_done).
 *
 * Why: while every ubatch keeps yielding SWITCH, the Python loop pays its own bytecode for each
 * switch (pop, install check, resume, compare, push). This loop does the same steps and nothing
 * else: pop the next ready ubatch, install what it resumes with, call its `resume`, push it back
 * if it switched, finish it if it returned (Endings._finish: its exit hook in its context); it
 * stops at anything the Python loop must decide (a park, an error, a pending timer or wake-up),
 * handing the ubatch and what happened back to it. release() is Endings._release_records, the
 * stores that free a finished run's records; counts() and same_counts() the reference counts that
 * tell whether a run shell can be reused (asyncdbo/_core/refcounts.py). Python stays the
 * reference: the kernel runs its Python loop where an instrument or an event-loop wait is
 * involved, and under ASYNCDBO_PURE_PYTHON=1 / ASYNCDBO_NO_C_KERNEL=1. Measurements of what it
 * saves are in benchmarks/results/ (benchmarks/host_overhead.py, switch_cost.py).
 *
 * It resumes a ubatch exactly as the Python loop does, through `ub.resume()`: a one-shot throw of
 * a cancellation, or (nearly always) the ubatch's `send`, the prebuilt `ctx.run(coro.send, None)`.
 * Where this module is loaded, UBatch builds that `send` as a Resume object (below) instead of a
 * functools.partial: the same call, whose context and coroutine this loop can read, so it runs the
 * send inline. Either loop drives the coroutine the record was built with.
 *
 * Safety: an exact UBatch is read at its slots (offsets taken by configure() from the type's own
 * member descriptors, asyncdbo/_native/slots.h), a deleted slot raising Python's AttributeError;
 * any other object (a subclass, asyncdbo.testing's tag logger) is read through its attributes.
 * Every object used across a call out to Python is held by a strong reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "slots.h"

/* What spin() reports; kernel.py has the same numbers. */
enum { SWITCHED = 0, PARKED = 1, FAILED = 2, EMPTY = 3, EXITED = 4, EXIT_FAILED = 5 };

enum {
    UB_RESUME, UB_RESUME_WITH,
    /* what start() fills */
    UB_RUN, UB_CORO, UB_CTX, UB_CTX_RUN, UB_SEND, UB_STATE, UB_TAG, UB_NUM_YIELDS, UB_UNAWAITED_AT, UB_CANCELS,
    /* what a finish and release() also store */
    UB_RESULT, UB_PARKED_ON, UB_EXT, UB_WAKER, UB_DEBUG, UB_UNAWAITED,
    UB_NSLOTS
};
static const char *const ub_names[UB_NSLOTS] = {
    "resume", "resume_with",
    "run", "coro", "ctx", "ctx_run", "send", "state", "tag", "num_yields", "unawaited_at", "cancels",
    "result", "parked_on", "ext", "waker", "debug", "unawaited",
};

typedef struct {
    PyTypeObject *ubatch_type; /* NULL until configure() */
    Py_ssize_t ub[UB_NSLOTS];
    PyTypeObject *resume_type;
    PyObject *str_run, *str_start; /* interned "run", "_start" */
    PyObject *str_live, *str_at_exit, *str_woken; /* interned "_live", "_at_exit", "_woken" (the run's) */
    PyObject *one;
    PyObject *getweakrefcount; /* _weakref.getweakrefcount, for counts() and same_counts() */
} SpinState;

/* ------------------------------------------------------------------ Resume */

/* Resume(ctx, coro)(): ctx.run(coro.send, None), as functools.partial(ctx.run, coro.send, None)
 * calls it: the send raises StopIteration(value) when the coroutine returns. Immutable. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *ctx, *coro;
    PyObject *send; /* coro.send, bound when made (so a coroutine without one fails there, as a
                       partial over coro.send would) and called, for anything but a native
                       coroutine or generator: NULL for those, whose send is run by PyIter_Send */
} ResumeObject;

static PyObject *resume_vectorcall(PyObject *, PyObject *const *, size_t, PyObject *);

/* A new Resume(ctx, coro) of `type`; ctx must be a Context (the caller checked). */
static PyObject *
resume_make(PyTypeObject *type, PyObject *ctx, PyObject *coro)
{
    PyObject *send = NULL;
    if (!PyCoro_CheckExact(coro) && !PyGen_CheckExact(coro)) {
        send = PyObject_GetAttrString(coro, "send");
        if (send == NULL)
            return NULL;
    }
    ResumeObject *r = (ResumeObject *)type->tp_alloc(type, 0);
    if (r == NULL) {
        Py_XDECREF(send);
        return NULL;
    }
    r->vectorcall = resume_vectorcall;
    r->ctx = Py_NewRef(ctx);
    r->coro = Py_NewRef(coro);
    r->send = send;
    return (PyObject *)r;
}

/* Run the send in the context: PYGEN_NEXT (yielded *result), PYGEN_RETURN (returned *result) or
 * PYGEN_ERROR (an error set, *result NULL). */
static PySendResult
resume_send(ResumeObject *r, PyObject **result)
{
    /* held for the call: what the coroutine runs may drop every other reference */
    PyObject *ctx = Py_NewRef(r->ctx), *coro = Py_NewRef(r->coro), *send = Py_XNewRef(r->send);
    PySendResult status;
    *result = NULL;
    if (PyContext_Enter(ctx) < 0) {
        status = PYGEN_ERROR;
        goto done;
    }
    if (PyCoro_CheckExact(coro) || PyGen_CheckExact(coro))
        status = PyIter_Send(coro, Py_None, result);
    else {
        *result = PyObject_CallOneArg(send, Py_None);
        status = *result != NULL ? PYGEN_NEXT : PYGEN_ERROR;
        if (status == PYGEN_ERROR && PyErr_ExceptionMatches(PyExc_StopIteration)) {
            /* its send returned (as the Python loop reads a StopIteration: a return, not a failure) */
            PyObject *stop = adb_take_exception();
            *result = PyObject_GetAttrString(stop, "value");
            Py_DECREF(stop);
            if (*result != NULL)
                status = PYGEN_RETURN;
        }
    }
    if (PyContext_Exit(ctx) < 0) {
        Py_CLEAR(*result);
        status = PYGEN_ERROR;
    }
done:
    Py_DECREF(ctx);
    Py_DECREF(coro);
    Py_XDECREF(send);
    return status;
}

static PyObject *
resume_vectorcall(PyObject *self, PyObject *const *Py_UNUSED(args), size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Resume() takes no arguments");
        return NULL;
    }
    PyObject *result;
    PySendResult status = resume_send((ResumeObject *)self, &result);
    if (status != PYGEN_RETURN)
        return result;
    /* coroutine.send() raises StopIteration(value) on return (a tuple value stays one argument) */
    PyObject *stop = PyObject_CallOneArg(PyExc_StopIteration, result);
    Py_DECREF(result);
    if (stop != NULL)
        PyErr_SetObject(PyExc_StopIteration, stop);
    Py_XDECREF(stop);
    return NULL;
}

static PyObject *
resume_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *ctx, *coro;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "Resume() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!O:Resume", &PyContext_Type, &ctx, &coro))
        return NULL;
    return resume_make(type, ctx, coro);
}

static int
resume_traverse(ResumeObject *r, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(r));
    Py_VISIT(r->ctx);
    Py_VISIT(r->coro);
    Py_VISIT(r->send);
    return 0;
}

static int
resume_clear(ResumeObject *r)
{
    Py_CLEAR(r->ctx);
    Py_CLEAR(r->coro);
    Py_CLEAR(r->send);
    return 0;
}

static void
resume_dealloc(ResumeObject *r)
{
    PyTypeObject *tp = Py_TYPE(r);
    PyObject_GC_UnTrack(r);
    resume_clear(r);
    tp->tp_free((PyObject *)r);
    Py_DECREF(tp);
}

static PyObject *
resume_repr(ResumeObject *r)
{
    return PyUnicode_FromFormat("<asyncdbo resume of %R>", r->coro != NULL ? r->coro : Py_None);
}

static PyMemberDef resume_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(ResumeObject, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot resume_slots[] = {
    {Py_tp_new, resume_new},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_traverse, resume_traverse},
    {Py_tp_clear, resume_clear},
    {Py_tp_dealloc, resume_dealloc},
    {Py_tp_repr, resume_repr},
    {Py_tp_members, resume_members},
    {Py_tp_doc, "Resume(ctx, coro)(): ctx.run(coro.send, None); what UBatch.send is where this module is loaded."},
    {0, NULL},
};

static PyType_Spec resume_spec = {
    .name = "asyncdbo._core._spin.Resume",
    .basicsize = sizeof(ResumeObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = resume_slots,
};

/* ------------------------------------------------------------------ spin */

static inline SpinState *
get_state(PyObject *module)
{
    return (SpinState *)PyModule_GetState(module);
}

/* The module state of a configured module, for an entry point `name` taking `want` arguments;
 * NULL with the exception set when the count is wrong or configure() was not called. */
static SpinState *
configured_state(PyObject *module, Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return NULL;
    }
    SpinState *st = get_state(module);
    if (st == NULL)
        return NULL;
    if (st->ubatch_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "asyncdbo._core._spin.configure() was not called");
        return NULL;
    }
    return st;
}

/* ub.<field> as a new reference: at its slot for an exact UBatch, else through the attribute. */
static inline PyObject *
ub_get(SpinState *st, PyObject *ub, int field)
{
    if (Py_IS_TYPE(ub, st->ubatch_type))
        return adb_slot_get(ub, st->ub[field], ub_names[field]);
    return PyObject_GetAttrString(ub, ub_names[field]);
}

/* (n, ub, status, value); steals ub and value. NULL (with the error) if the tuple can't be made. */
static PyObject *
report(Py_ssize_t n, PyObject *ub, int status, PyObject *value)
{
    PyObject *k = PyLong_FromSsize_t(n);
    PyObject *code = k == NULL ? NULL : PyLong_FromLong(status);
    PyObject *r = code == NULL ? NULL : PyTuple_New(4);
    if (r == NULL) {
        Py_XDECREF(k);
        Py_XDECREF(code);
        Py_DECREF(ub);
        Py_DECREF(value);
        return NULL;
    }
    /* built in place, as Py_BuildValue's format parser would (every run ends with one report) */
    PyTuple_SET_ITEM(r, 0, k);
    PyTuple_SET_ITEM(r, 1, ub);
    PyTuple_SET_ITEM(r, 2, code);
    PyTuple_SET_ITEM(r, 3, value);
    return r;
}

/* The error just raised, as an exception object with its traceback; a SystemError if none was set
 * (a callee that returned NULL without one), so FAILED always carries an exception. */
static PyObject *
take_error(void)
{
    PyObject *exc = adb_take_exception();
    if (exc == NULL) {
        PyErr_SetString(PyExc_SystemError, "asyncdbo._core._spin: a call failed without setting an exception");
        exc = adb_take_exception();
    }
    return exc;
}

/* ub.<field> = value: at its slot while `ub` is an exact UBatch (checked at each store: what a
 * store releases may run a finalizer that reassigns __class__), else through setattr. */
static int
ub_set(SpinState *st, PyObject *ub, int field, PyObject *value)
{
    if (Py_IS_TYPE(ub, st->ubatch_type)) {
        adb_slot_set(ub, st->ub[field], value);
        return 0;
    }
    return PyObject_SetAttrString(ub, ub_names[field], value);
}

/* Endings._finish on the C path (which runs only without an instrument): `ub` returned `result`.
 * ub.state = done; ub.result = result; ub.parked_on = None; run._live -= 1; then, where the run
 * has an exit hook, ub.ctx_run(run._at_exit, ub). 0; -1 with the error set where the bookkeeping
 * failed (it propagates, as from _finish); 1 with the error set where the exit hook raised, or
 * reading ub.ctx_run did (both inside _finish's try): the ubatch failed at its exit. */
static int
finish(SpinState *st, PyObject *ub, PyObject *result, PyObject *run, PyObject *done)
{
    if (ub_set(st, ub, UB_STATE, done) < 0 || ub_set(st, ub, UB_RESULT, result) < 0
        || ub_set(st, ub, UB_PARKED_ON, Py_None) < 0)
        return -1;
    PyObject *live = PyObject_GetAttr(run, st->str_live);
    if (live == NULL)
        return -1;
    PyObject *less = PyNumber_InPlaceSubtract(live, st->one);
    Py_DECREF(live);
    if (less == NULL)
        return -1;
    int rc = PyObject_SetAttr(run, st->str_live, less);
    Py_DECREF(less);
    if (rc < 0)
        return -1;
    PyObject *at_exit = PyObject_GetAttr(run, st->str_at_exit);
    if (at_exit == NULL)
        return -1;
    if (at_exit == Py_None) {
        Py_DECREF(at_exit);
        return 0;
    }
    PyObject *r = NULL, *ctx_run = ub_get(st, ub, UB_CTX_RUN);
    if (ctx_run != NULL) {
        PyObject *argv[2] = {at_exit, ub};
        r = PyObject_Vectorcall(ctx_run, argv, 2, NULL);
        Py_DECREF(ctx_run);
    }
    Py_DECREF(at_exit);
    if (r == NULL)
        return 1;
    Py_DECREF(r);
    return 0;
}

/* What the Python loop asks after a finish: `self._woken or self._timers` (its exit woke or armed
 * something, to be drained out there first). 1, 0, or -1 with an error set. */
static int
exit_pending(SpinState *st, PyObject *run, PyObject *timers)
{
    PyObject *woken = PyObject_GetAttr(run, st->str_woken);
    if (woken == NULL)
        return -1;
    int pending = PyObject_IsTrue(woken);
    Py_DECREF(woken);
    if (pending != 0)
        return pending;
    return PyList_GET_SIZE(timers) > 0;
}

/* spin(pop, push, woken, timers, switch, install, run, done) -> (switches, ubatch, status, value)
 *
 * Resume ubatches in ring order while each yields `switch`, counting the switches; before each
 * resume, `install(ubatch.resume_with)` unless `install` is None (the run's install, which does
 * nothing when that stream is current already; an error from it propagates, as from the Python
 * loop). Returns when a ubatch does anything else: PARKED (value: what it yielded), FAILED (value:
 * the exception, not raised); or when it switched and `timers` (a list) or `woken` (a sized
 * container, or None to ignore it) is not empty: SWITCHED, the ubatch not pushed back yet. EMPTY
 * when the ring is empty.
 *
 * A ubatch that returns is finished here as the Python loop finishes it (Endings._finish on
 * `run`, with `done` the UBatchState.DONE: its exit hook runs in its context) and the loop goes
 * on; it returns EXITED (value None) once such an exit left the run's `_woken` or `timers` not
 * empty, and EXIT_FAILED (value: the exception, not raised) where the exit hook raised. A run
 * whose ubatches only switch is then one call, however many ubatches it has. */
static PyObject *
spin(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    SpinState *st = configured_state(module, nargs, 8, "spin");
    if (st == NULL)
        return NULL;
    /* The arguments are the caller's (alive for the call); `timers` must stay a list. */
    PyObject *pop = args[0], *push = args[1], *woken = args[2], *timers = args[3], *switch_ = args[4];
    PyObject *install = args[5] == Py_None ? NULL : args[5];
    PyObject *run = args[6], *done = args[7];
    if (!PyList_Check(timers)) {
        PyErr_SetString(PyExc_TypeError, "spin(): timers must be a list");
        return NULL;
    }
    if (run == Py_None) {
        PyErr_SetString(PyExc_TypeError, "spin(): run must be the DBORun whose ubatches it resumes, not None");
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
        if (install != NULL) {
            PyObject *with = ub_get(st, ub, UB_RESUME_WITH);
            PyObject *r = with == NULL ? NULL : PyObject_CallOneArg(install, with);
            Py_XDECREF(with);
            if (r == NULL) {
                Py_DECREF(ub);
                return NULL;
            }
            Py_DECREF(r);
        }
        PyObject *resume = ub_get(st, ub, UB_RESUME);
        if (resume == NULL) /* as the Python loop's `ub.resume()`: the ubatch fails with it */
            return report(n, ub, FAILED, take_error());
        PyObject *result, *value;
        if (Py_IS_TYPE(resume, st->resume_type)) { /* its send, inline */
            PySendResult r = resume_send((ResumeObject *)resume, &result);
            Py_DECREF(resume);
            if (r == PYGEN_ERROR)
                return report(n, ub, FAILED, take_error());
            if (r == PYGEN_RETURN) {
                value = result;
                goto returned;
            }
        }
        else {
            result = PyObject_CallNoArgs(resume);
            Py_DECREF(resume);
        }
        if (result == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_StopIteration))
                return report(n, ub, FAILED, take_error());
            PyObject *stop = adb_take_exception();
            value = PyObject_GetAttrString(stop, "value");
            Py_DECREF(stop);
            if (value == NULL)
                return report(n, ub, FAILED, take_error());
            goto returned;
        }
        if (result != switch_)
            return report(n, ub, PARKED, result);
        Py_DECREF(result);
        n++;
        int pending = PyList_GET_SIZE(timers) > 0;
        if (!pending && woken != NULL) {
            Py_ssize_t len = PyObject_Length(woken);
            if (len < 0) {
                Py_DECREF(ub);
                return NULL;
            }
            pending = len > 0;
        }
        if (pending)
            return report(n, ub, SWITCHED, Py_NewRef(Py_None));
        PyObject *r = PyObject_CallOneArg(push, ub);
        Py_DECREF(ub);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
        continue;
    returned: /* `ub` returned `value` (both owned here) */
        int rc = finish(st, ub, value, run, done);
        Py_DECREF(value);
        if (rc > 0)
            return report(n, ub, EXIT_FAILED, take_error());
        if (rc == 0)
            rc = exit_pending(st, run, timers);
        if (rc > 0)
            return report(n, ub, EXITED, Py_NewRef(Py_None));
        Py_DECREF(ub);
        if (rc < 0)
            return NULL;
    }
}

/* release(ubatches): Endings._release_records: each record's result read (the list of them is
 * returned, in the records' order), then its coroutine, context, resume, state of the layer above,
 * what it waited on, result and run set to None, in that method's order, at its slots while it is
 * an exact UBatch and else through getattr/setattr (whose error propagates, the rest left as they
 * are, as from the Python loop). Each replaced value is released at once (a finalizer it runs may
 * reassign __class__: the type is checked again before every store); the list is read at each
 * step, as a for loop reads it. */
static PyObject *
release(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const int order[] = {UB_CORO, UB_CTX, UB_CTX_RUN, UB_SEND, UB_RESUME, UB_EXT, UB_WAKER, UB_PARKED_ON,
                                UB_RESULT, UB_RESUME_WITH, UB_DEBUG, UB_UNAWAITED, UB_RUN};
    SpinState *st = configured_state(module, nargs, 1, "release");
    if (st == NULL)
        return NULL;
    PyObject *ubs = args[0];
    if (!PyList_Check(ubs)) {
        PyErr_SetString(PyExc_TypeError, "release(): ubatches must be a list");
        return NULL;
    }
    PyObject *results = PyList_New(0);
    if (results == NULL)
        return NULL;
    Py_INCREF(ubs); /* held: a finalizer run by a store may drop the caller's reference */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ubs); i++) {
        PyObject *ub = Py_NewRef(PyList_GET_ITEM(ubs, i));
        PyObject *result = ub_get(st, ub, UB_RESULT);
        int rc = result == NULL ? -1 : PyList_Append(results, result);
        Py_XDECREF(result);
        for (size_t k = 0; rc == 0 && k < sizeof order / sizeof order[0]; k++)
            rc = ub_set(st, ub, order[k], Py_None);
        Py_DECREF(ub);
        if (rc < 0) {
            Py_DECREF(ubs);
            Py_DECREF(results);
            return NULL;
        }
    }
    Py_DECREF(ubs);
    return results;
}

/* Fill one UBatch for a run of `coro` as UBatch._start does: the fallible steps first (the
 * context copy, its bound run, the Resume, the contextvar set inside the new context), then the
 * stores in _start's order, each at its slot while `ub` is an exact UBatch and else through
 * setattr, each replaced value released at once as the member descriptor releases it (a finalizer
 * it runs may reassign __class__: the type is checked again before every store). 0, or -1 with an
 * error set. */
static int
start_one(SpinState *st, PyObject *ub, PyObject *run, PyObject *coro, PyObject *var, PyObject *ready)
{
    /* in _start's order: run, coro, ctx, ctx_run, send, resume, state, tag, num_yields, unawaited_at, cancels */
    static const int order[] = {UB_RUN, UB_CORO, UB_CTX, UB_CTX_RUN, UB_SEND, UB_RESUME, UB_STATE, UB_TAG,
                                UB_NUM_YIELDS, UB_UNAWAITED_AT, UB_CANCELS};
    PyObject *vals[UB_NSLOTS] = {NULL}, *ctx_run = NULL, *resume = NULL, *zero = NULL, *token;
    int rc = -1;
    PyObject *ctx = PyContext_CopyCurrent();
    if (ctx == NULL)
        return -1;
    if ((ctx_run = PyObject_GetAttr(ctx, st->str_run)) == NULL
        || (resume = resume_make(st->resume_type, ctx, coro)) == NULL || (zero = PyLong_FromLong(0)) == NULL)
        goto done;
    if (PyContext_Enter(ctx) < 0)
        goto done;
    token = PyContextVar_Set(var, ub);
    if (PyContext_Exit(ctx) < 0 || token == NULL) {
        Py_XDECREF(token);
        goto done;
    }
    Py_DECREF(token);
    vals[UB_RUN] = run;
    vals[UB_CORO] = coro;
    vals[UB_CTX] = ctx;
    vals[UB_CTX_RUN] = ctx_run;
    vals[UB_SEND] = resume;
    vals[UB_RESUME] = resume;
    vals[UB_STATE] = ready;
    vals[UB_TAG] = Py_None;
    vals[UB_NUM_YIELDS] = zero;
    vals[UB_UNAWAITED_AT] = Py_None;
    vals[UB_CANCELS] = zero;
    for (size_t k = 0; k < sizeof order / sizeof order[0]; k++)
        if (ub_set(st, ub, order[k], vals[order[k]]) < 0)
            goto done;
    rc = 0;
done:
    Py_DECREF(ctx);
    Py_XDECREF(ctx_run);
    Py_XDECREF(resume);
    Py_XDECREF(zero);
    return rc;
}

/* start(ubatches, run, coros, var, ready): for ub, coro in zip(ubatches, coros): ub._start(run, coro)
 * (DBORun.restart's loop), with `var` (current_ubatch) and `ready` (UBatchState.READY) passed in.
 * An exact UBatch is filled here (start_one), anything else through its own _start. Both lists
 * are read at each step, as zip reads them. */
static PyObject *
start(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    SpinState *st = configured_state(module, nargs, 5, "start");
    if (st == NULL)
        return NULL;
    PyObject *ubs = args[0], *run = args[1], *coros = args[2], *var = args[3], *ready = args[4];
    if (!PyList_Check(ubs) || !PyList_Check(coros)) {
        PyErr_SetString(PyExc_TypeError, "start(): ubatches and coros must be lists");
        return NULL;
    }
    if (!PyContextVar_CheckExact(var)) {
        PyErr_Format(PyExc_TypeError, "start(): var must be a ContextVar (got %R)", var);
        return NULL;
    }
    /* held: a finalizer run by a store may drop the caller's references */
    Py_INCREF(ubs);
    Py_INCREF(coros);
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ubs) && i < PyList_GET_SIZE(coros); i++) {
        PyObject *ub = Py_NewRef(PyList_GET_ITEM(ubs, i)), *coro = Py_NewRef(PyList_GET_ITEM(coros, i));
        int rc;
        if (Py_IS_TYPE(ub, st->ubatch_type))
            rc = start_one(st, ub, run, coro, var, ready);
        else {
            PyObject *r = PyObject_CallMethodObjArgs(ub, st->str_start, run, coro, NULL);
            rc = r == NULL ? -1 : 0;
            Py_XDECREF(r);
        }
        Py_DECREF(ub);
        Py_DECREF(coro);
        if (rc < 0)
            goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(ubs);
    Py_DECREF(coros);
    return result;
}

/* ------------------------------------------------------------------ counts, same_counts */

/* The reference counts asyncdbo.dbo.shell and the host backend compare to tell that nothing but a
 * run shell refers to its objects (asyncdbo/_core/refcounts.py has the Python twins and the
 * contract). Each count of `objs` is Py_REFCNT of the object as `objs` holds it, each of `weak`
 * what _weakref.getweakrefcount returns for it; the strong counts are all read before any call
 * out, as the twins read them (a tuple made before it is compared). */

#define COUNTS_ON_STACK 256

/* The counts of `objs` (a tuple) then `weak` (a tuple) into `out` (room for both); 0, or -1 with
 * the error of a getweakrefcount call set. */
static int
read_counts(SpinState *st, PyObject *objs, PyObject *weak, Py_ssize_t *out)
{
    Py_ssize_t ns = PyTuple_GET_SIZE(objs), nw = PyTuple_GET_SIZE(weak);
    for (Py_ssize_t i = 0; i < ns; i++)
        out[i] = Py_REFCNT(PyTuple_GET_ITEM(objs, i));
    for (Py_ssize_t j = 0; j < nw; j++) {
        PyObject *obj = Py_NewRef(PyTuple_GET_ITEM(weak, j)); /* held across the call out */
        PyObject *r = PyObject_CallOneArg(st->getweakrefcount, obj);
        Py_DECREF(obj);
        if (r == NULL)
            return -1;
        Py_ssize_t v = PyLong_Check(r) ? PyLong_AsSsize_t(r) : -1;
        if (!PyLong_Check(r))
            PyErr_Format(PyExc_TypeError, "getweakrefcount() returned %R, not an int", r);
        Py_DECREF(r);
        if (v == -1 && PyErr_Occurred())
            return -1;
        out[ns + j] = v;
    }
    return 0;
}

/* The state and the two tuples of a counts()/same_counts() call of `want` arguments; NULL with a
 * TypeError when they are not tuples (both twins raise the same). */
static SpinState *
counts_args(PyObject *module, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return NULL;
    }
    if (!PyTuple_CheckExact(args[0]) || !PyTuple_CheckExact(args[1])) {
        PyErr_Format(PyExc_TypeError, "%s(): objs and weak must be tuples (got %.100s and %.100s)", name,
                     Py_TYPE(args[0])->tp_name, Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    SpinState *st = get_state(module);
    if (st != NULL && st->getweakrefcount == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "asyncdbo._core._spin: the module is not initialized");
        return NULL;
    }
    return st;
}

/* A buffer for `n` counts: `stack` when it fits, else allocated (NULL with MemoryError set). */
static Py_ssize_t *
counts_buffer(Py_ssize_t n, Py_ssize_t *stack)
{
    if (n <= COUNTS_ON_STACK)
        return stack;
    Py_ssize_t *buf = PyMem_New(Py_ssize_t, n);
    if (buf == NULL)
        PyErr_NoMemory();
    return buf;
}

/* counts(objs, weak) -> tuple of ints: the strong counts of objs, then the weak counts of weak. */
static PyObject *
counts(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    SpinState *st = counts_args(module, args, nargs, 2, "counts");
    if (st == NULL)
        return NULL;
    PyObject *objs = args[0], *weak = args[1];
    Py_ssize_t n = PyTuple_GET_SIZE(objs) + PyTuple_GET_SIZE(weak), stack[COUNTS_ON_STACK];
    Py_ssize_t *buf = counts_buffer(n, stack);
    if (buf == NULL)
        return NULL;
    PyObject *result = NULL;
    if (read_counts(st, objs, weak, buf) == 0 && (result = PyTuple_New(n)) != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = PyLong_FromSsize_t(buf[i]);
            if (v == NULL) {
                Py_CLEAR(result);
                break;
            }
            PyTuple_SET_ITEM(result, i, v);
        }
    }
    if (buf != stack)
        PyMem_Free(buf);
    return result;
}

/* Whether count `c` equals `item` (borrowed from a tuple the caller holds): 1, 0, or -1 with an
 * error. An exact int is compared here; anything else as tuple equality compares it, with `==`
 * (which may call out: the item is held across it). */
static int
count_equals(Py_ssize_t c, PyObject *item)
{
    if (PyLong_CheckExact(item)) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (v == -1 && PyErr_Occurred())
            return -1;
        return !overflow && v == (long long)c;
    }
    PyObject *count = PyLong_FromSsize_t(c);
    if (count == NULL)
        return -1;
    Py_INCREF(item);
    int eq = PyObject_RichCompareBool(count, item, Py_EQ);
    Py_DECREF(item);
    Py_DECREF(count);
    return eq;
}

/* same_counts(objs, weak, expected) -> bool: counts(objs, weak) == expected, False at once when
 * expected is not an exact tuple of as many entries; the entries are compared in order up to the
 * first that differs, as tuple equality compares them. */
static PyObject *
same_counts(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    SpinState *st = counts_args(module, args, nargs, 3, "same_counts");
    if (st == NULL)
        return NULL;
    PyObject *objs = args[0], *weak = args[1], *expected = args[2];
    Py_ssize_t n = PyTuple_GET_SIZE(objs) + PyTuple_GET_SIZE(weak), stack[COUNTS_ON_STACK];
    if (!PyTuple_CheckExact(expected) || PyTuple_GET_SIZE(expected) != n)
        Py_RETURN_FALSE;
    Py_ssize_t *buf = counts_buffer(n, stack);
    if (buf == NULL)
        return NULL;
    int same = -1;
    Py_INCREF(expected); /* held: a comparison may call out */
    if (read_counts(st, objs, weak, buf) == 0) {
        same = 1;
        for (Py_ssize_t i = 0; i < n && same == 1; i++)
            same = count_equals(buf[i], PyTuple_GET_ITEM(expected, i));
    }
    Py_DECREF(expected);
    if (buf != stack)
        PyMem_Free(buf);
    if (same < 0)
        return NULL;
    return PyBool_FromLong(same);
}

/* configure(UBatch): the record whose slots spin() reads. All or nothing: a type that lacks a slot
 * raises TypeError and leaves the previous configuration in place. */
static PyObject *
configure(PyObject *module, PyObject *tp)
{
    if (!PyType_Check(tp)) {
        PyErr_Format(PyExc_TypeError, "configure() needs the UBatch type (got %R)", tp);
        return NULL;
    }
    SpinState *st = get_state(module);
    if (st == NULL)
        return NULL;
    Py_ssize_t offs[UB_NSLOTS];
    if (adb_member_offsets((PyTypeObject *)tp, ub_names, offs, UB_NSLOTS) < 0)
        return NULL;
    /* commit: the offsets and the type they belong to, with no call out in between */
    PyTypeObject *old = st->ubatch_type;
    memcpy(st->ub, offs, sizeof offs);
    st->ubatch_type = (PyTypeObject *)Py_NewRef(tp);
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"spin", (PyCFunction)(void (*)(void))spin, METH_FASTCALL,
     "spin(pop, push, woken, timers, switch, install, run, done) -> (switches, ubatch, status, value): the kernel's "
     "fast loop."},
    {"release", (PyCFunction)(void (*)(void))release, METH_FASTCALL,
     "release(ubatches): Endings._release_records: each record's run state set to None; the list of their results."},
    {"start", (PyCFunction)(void (*)(void))start, METH_FASTCALL,
     "start(ubatches, run, coros, var, ready): each UBatch._start(run, coro), as DBORun.restart runs them."},
    {"counts", (PyCFunction)(void (*)(void))counts, METH_FASTCALL,
     "counts(objs, weak) -> tuple: each object's reference count, then each of weak's weak reference count "
     "(asyncdbo._core.refcounts)."},
    {"same_counts", (PyCFunction)(void (*)(void))same_counts, METH_FASTCALL,
     "same_counts(objs, weak, expected) -> bool: counts(objs, weak) == expected (asyncdbo._core.refcounts)."},
    {"configure", configure, METH_O, "configure(UBatch): the record whose slots spin() and start() use."},
    {NULL, NULL, 0, NULL},
};

static int
module_exec(PyObject *m)
{
    SpinState *st = get_state(m);
    st->resume_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &resume_spec, NULL);
    if (st->resume_type == NULL || PyModule_AddObjectRef(m, "Resume", (PyObject *)st->resume_type) < 0)
        return -1;
    if ((st->str_run = PyUnicode_InternFromString("run")) == NULL
        || (st->str_start = PyUnicode_InternFromString("_start")) == NULL
        || (st->str_live = PyUnicode_InternFromString("_live")) == NULL
        || (st->str_at_exit = PyUnicode_InternFromString("_at_exit")) == NULL
        || (st->str_woken = PyUnicode_InternFromString("_woken")) == NULL
        || (st->one = PyLong_FromLong(1)) == NULL)
        return -1;
    PyObject *weakref_mod = PyImport_ImportModule("_weakref");
    if (weakref_mod == NULL)
        return -1;
    st->getweakrefcount = PyObject_GetAttrString(weakref_mod, "getweakrefcount");
    Py_DECREF(weakref_mod);
    if (st->getweakrefcount == NULL)
        return -1;
    if (PyModule_AddIntConstant(m, "SWITCHED", SWITCHED) || PyModule_AddIntConstant(m, "PARKED", PARKED)
        || PyModule_AddIntConstant(m, "FAILED", FAILED)
        || PyModule_AddIntConstant(m, "EMPTY", EMPTY) || PyModule_AddIntConstant(m, "EXITED", EXITED)
        || PyModule_AddIntConstant(m, "EXIT_FAILED", EXIT_FAILED))
        return -1;
    return 0;
}

static int
module_traverse(PyObject *m, visitproc visit, void *arg)
{
    SpinState *st = get_state(m);
    if (st != NULL) {
        Py_VISIT(st->ubatch_type);
        Py_VISIT(st->resume_type);
        Py_VISIT(st->str_run);
        Py_VISIT(st->str_start);
        Py_VISIT(st->str_live);
        Py_VISIT(st->str_at_exit);
        Py_VISIT(st->str_woken);
        Py_VISIT(st->one);
        Py_VISIT(st->getweakrefcount);
    }
    return 0;
}

static int
module_clear(PyObject *m)
{
    SpinState *st = get_state(m);
    if (st != NULL) {
        Py_CLEAR(st->ubatch_type);
        Py_CLEAR(st->resume_type);
        Py_CLEAR(st->str_run);
        Py_CLEAR(st->str_start);
        Py_CLEAR(st->str_live);
        Py_CLEAR(st->str_at_exit);
        Py_CLEAR(st->str_woken);
        Py_CLEAR(st->one);
        Py_CLEAR(st->getweakrefcount);
    }
    return 0;
}

static void
module_free(void *m)
{
    module_clear((PyObject *)m);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
    /* Thread safety: this module relies on the GIL. spin() reads and writes slots of the records
     * of one run with plain loads and stores, which is safe only while no other thread can touch
     * them; the kernel drives a run on one thread, but nothing stops a user's thread from
     * touching a record, which under the GIL is merely wrong and without it could free an object
     * under us. On a free-threaded build asyncdbo does not load the extensions while the GIL is
     * disabled (asyncdbo/_core/extensions.py) and runs the Python loop, which is safe there. */
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef spin_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "asyncdbo._core._spin",
    .m_doc = "The kernel's fast loop in C; asyncdbo._core.kernel is the reference.",
    .m_size = sizeof(SpinState),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__spin(void)
{
    return PyModuleDef_Init(&spin_module);
}
