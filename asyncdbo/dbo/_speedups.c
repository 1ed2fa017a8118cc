/* C fast paths of the four kinds of DBO yield and switch primitive (asyncdbo/dbo/kinds.py; the
 * primitives themselves are rows of asyncdbo/dbo/table.py, each a Primitive object of its kind).
 *
 * Why: a yield primitive in Python is a call, a generator object and two frames per yield; the
 * `ht` layer calls six of them for its three yields. Here each primitive is a vectorcall object
 * and the awaitable it returns is a small iterator with a state machine instead of a generator
 * frame. What that saves is measured by benchmarks/host_overhead.py (benchmarks/results/).
 *
 * The contract: Python stays the reference. A Primitive handles only the common case (a plain
 * positional call inside a run, nothing pending, not in debug mode, the ubatch on the expected
 * role, a known tag, exact UBatch and Lane records with every slot it checks present) and it
 * checks all of that before it changes anything; anything else calls the Python implementation
 * with the same arguments, which raises the same errors as always. Past that point it does what
 * the Python code does, in the same order, and raises what it raises (a deleted slot:
 * AttributeError; a missing key: KeyError). tests/dbo/test_speedups.py and tests/native/ run the
 * same programs on both and compare whole traces, errors and what is left alive.
 *
 * Safety rules (each has a test in tests/native/): slots are read through asyncdbo/_native/slots.h
 * (offsets from the configured type's own member descriptors, committed all at once; the exact
 * type re-checked at every access, since a call out may reassign __class__); every object used
 * across a call out to Python is held by a strong reference; a Step is not re-entered while it
 * runs (ValueError, as a generator's "already executing").
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "slots.h"

/* ------------------------------------------------------------------ module state */

enum { UB_UNAWAITED, UB_UNAWAITED_AT, UB_DEBUG, UB_EXT, UB_TAG, UB_RESUME_WITH, UB_NSLOTS };
static const char *const ub_names[UB_NSLOTS] = {"unawaited", "unawaited_at", "debug", "ext", "tag", "resume_with"};
enum { L_ROLE, L_STREAM, L_STREAMS, L_EVENTS, L_RECORD, L_WAIT, L_INSTALL, L_NSLOTS };
static const char *const lane_names[L_NSLOTS] = {"role", "stream", "streams", "events", "record", "wait", "install"};

typedef struct {
    PyTypeObject *step_type, *primitive_type;
    /* set by configure(), all together */
    PyObject *current_ubatch;               /* the contextvar holding the running UBatch */
    PyTypeObject *ubatch_type, *lane_type;
    PyObject *switch_;                      /* the kernel's SWITCH request */
    PyObject *completed;                    /* the shared done awaitable */
    Py_ssize_t ub[UB_NSLOTS], lane[L_NSLOTS];
    /* the int objects of the call sites' offsets (lasti) below 2 * LASTI_CACHED, made on first use:
     * a primitive records its caller's offset on every call, and a new int per call (an allocation
     * and a free for an offset past the small-int cache) was a third of what naming the line cost */
#define LASTI_CACHED 2048
    PyObject *lasti[LASTI_CACHED];
    /* freed Steps kept for the next ones (Cython's freelist: PyObject_Init on the kept memory, untracked
     * and holding nothing): every primitive call makes one and its await frees it, and an allocation
     * and a free per call were a tenth of a yield's host time (perf, benchmarks/compare_commits.py --own) */
#define STEPS_KEPT 16
    PyObject *kept[STEPS_KEPT];
    int nkept;
} State;

static inline State *
state_of_type(PyTypeObject *tp)
{
    return (State *)PyType_GetModuleState(tp);
}

/* Field access: at the slot for an exact instance of the configured type, else the attribute. */
static inline PyObject *
ub_get(State *st, PyObject *ub, int f)
{
    if (Py_IS_TYPE(ub, st->ubatch_type))
        return adb_slot_get(ub, st->ub[f], ub_names[f]);
    return PyObject_GetAttrString(ub, ub_names[f]);
}

static inline int
ub_set(State *st, PyObject *ub, int f, PyObject *v)
{
    if (Py_IS_TYPE(ub, st->ubatch_type)) {
        adb_slot_set(ub, st->ub[f], v);
        return 0;
    }
    return PyObject_SetAttrString(ub, ub_names[f], v);
}

static inline PyObject *
lane_get(State *st, PyObject *lane, int f)
{
    if (Py_IS_TYPE(lane, st->lane_type))
        return adb_slot_get(lane, st->lane[f], lane_names[f]);
    return PyObject_GetAttrString(lane, lane_names[f]);
}

static inline int
lane_set(State *st, PyObject *lane, int f, PyObject *v)
{
    if (Py_IS_TYPE(lane, st->lane_type)) {
        adb_slot_set(lane, st->lane[f], v);
        return 0;
    }
    return PyObject_SetAttrString(lane, lane_names[f], v);
}

/* A slot's value, borrowed, for the checks made before anything changes (NULL: deleted). */
static inline PyObject *
peek(PyObject *obj, Py_ssize_t off)
{
    return ADB_SLOT(obj, off);
}

/* fn(a, b) by vectorcall; the caller holds fn, a and b. */
static inline PyObject *
call2(PyObject *fn, PyObject *a, PyObject *b)
{
    PyObject *args[3] = {NULL, a, b};
    return PyObject_Vectorcall(fn, args + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* mapping[key] as a new reference (a plain dict without the generic call; KeyError(key) as
 * Python raises it, even for a tuple key). */
static PyObject *
get_item(PyObject *mapping, PyObject *key)
{
    if (PyDict_CheckExact(mapping)) {
        PyObject *v = PyDict_GetItemWithError(mapping, key);
        if (v != NULL)
            return Py_NewRef(v);
        if (!PyErr_Occurred()) {
            PyObject *args = PyTuple_Pack(1, key);
            if (args != NULL) {
                PyErr_SetObject(PyExc_KeyError, args);
                Py_DECREF(args);
            }
        }
        return NULL;
    }
    return PyObject_GetItem(mapping, key);
}

/* lane.<f>[key], evaluated as Python does (the attribute, then the subscript). */
static PyObject *
lane_item(State *st, PyObject *lane, int f, PyObject *key)
{
    PyObject *mapping = lane_get(st, lane, f);
    if (mapping == NULL)
        return NULL;
    PyObject *v = get_item(mapping, key);
    Py_DECREF(mapping);
    return v;
}

/* Where the calling Python code is: (code, lasti) of the frame that called the primitive, what
 * the missing-await report turns into file:line (asyncdbo.dbo.awaits). None without a frame.
 * ``reuse``: the pair the slot holds now, or NULL. Where nothing but the slot refers to it (only
 * a caller that kept ``ub.unawaited_at`` could; the count is exact under the GIL, which the
 * module requires), it is refilled in place and returned, as zip() and enumerate() reuse their
 * result tuple: a primitive records a site per call, and a new tuple per call was the larger part
 * of that cost (benchmarks/instructions.py). Its old items go to ``dropped`` (new references, or
 * NULL) for the caller to release once the ubatch's fields are all stored: their release may run
 * code (a weakref callback on a code object), which then sees what Python's primitives leave. */
static PyObject *
caller_site(State *st, PyObject *reuse, PyObject *dropped[2])
{
    PyFrameObject *f = PyEval_GetFrame(); /* borrowed */
    if (f == NULL)
        return Py_NewRef(Py_None);
    PyCodeObject *code = PyFrame_GetCode(f); /* new reference */
    int at = PyFrame_GetLasti(f);
    PyObject *lasti;
    if (at >= 0 && at < 2 * LASTI_CACHED && !(at & 1)) { /* an offset in bytes: even (code units are two) */
        PyObject **slot = &st->lasti[at >> 1];
        if (*slot == NULL)
            *slot = PyLong_FromLong(at); /* stays NULL where it failed: the error is raised below */
        lasti = Py_XNewRef(*slot);
    }
    else
        lasti = PyLong_FromLong(at);
    if (lasti == NULL) {
        Py_DECREF(code);
        return NULL;
    }
    if (reuse != NULL && PyTuple_CheckExact(reuse) && PyTuple_GET_SIZE(reuse) == 2 && Py_REFCNT(reuse) == 1) {
        if (PyTuple_GET_ITEM(reuse, 0) == (PyObject *)code && PyTuple_GET_ITEM(reuse, 1) == lasti) {
            Py_DECREF(code); /* the same site as last time: the pair holds them already */
            Py_DECREF(lasti);
            return Py_NewRef(reuse);
        }
        dropped[0] = PyTuple_GET_ITEM(reuse, 0);
        dropped[1] = PyTuple_GET_ITEM(reuse, 1);
        PyTuple_SET_ITEM(reuse, 0, (PyObject *)code);
        PyTuple_SET_ITEM(reuse, 1, lasti);
        if (!PyObject_GC_IsTracked(reuse)) /* the collector may have untracked it: zip() does the same */
            PyObject_GC_Track(reuse);
        return Py_NewRef(reuse);
    }
    PyObject *site = PyTuple_New(2);
    if (site == NULL) {
        Py_DECREF(code);
        Py_DECREF(lasti);
        return NULL;
    }
    /* built in place, not by Py_BuildValue's format parser */
    PyTuple_SET_ITEM(site, 0, (PyObject *)code);
    PyTuple_SET_ITEM(site, 1, lasti);
    return site;
}

/* Python's: lane.role = role; lane.stream = ub.resume_with = stream = lane.streams[role];
 * if lane.install is not None: lane.install(stream). Returns the stream (new reference). */
static PyObject *
enter_role(State *st, PyObject *ub, PyObject *lane, PyObject *role)
{
    if (lane_set(st, lane, L_ROLE, role) < 0)
        return NULL;
    PyObject *stream = lane_item(st, lane, L_STREAMS, role);
    if (stream == NULL)
        return NULL;
    if (lane_set(st, lane, L_STREAM, stream) < 0 || ub_set(st, ub, UB_RESUME_WITH, stream) < 0)
        goto fail;
    PyObject *install = lane_get(st, lane, L_INSTALL);
    if (install == NULL)
        goto fail;
    if (install != Py_None) {
        PyObject *r = PyObject_CallOneArg(install, stream);
        if (r == NULL) {
            Py_DECREF(install);
            goto fail;
        }
        Py_DECREF(r);
    }
    Py_DECREF(install);
    return stream;
fail:
    Py_DECREF(stream);
    return NULL;
}

/* ------------------------------------------------------------------ the awaitable */

enum { K_SWITCH, K_ROLE, K_WAIT }; /* traps.switch, primitives._yield_and_switch, ._then_wait */
enum { S_START, S_YIELDED, S_WAITING, S_DONE };

typedef struct {
    PyObject_HEAD
    int kind, state, running;
    PyObject *ub, *lane, *tag, *src, *dst;
    PyObject *event; /* K_ROLE: the src done-event (after the yield); K_WAIT: the signal or None */
    PyObject *sub;   /* S_WAITING: the signal's __await__ iterator */
    State *st;       /* its module's state, which outlives it (it holds its type, which holds the module) */
} StepObject;

static PyObject *
step_new(State *st, int kind, PyObject *ub, PyObject *lane, PyObject *tag, PyObject *src, PyObject *dst,
         PyObject *event)
{
    StepObject *s;
    if (st->nkept > 0) {
        s = (StepObject *)st->kept[--st->nkept];
        st->kept[st->nkept] = NULL;
        (void)PyObject_Init((PyObject *)s, st->step_type); /* its type and one reference (a heap type: held) */
    }
    else if ((s = PyObject_GC_New(StepObject, st->step_type)) == NULL)
        return NULL;
    s->kind = kind;
    s->state = S_START;
    s->running = 0;
    s->ub = Py_XNewRef(ub);
    s->lane = Py_XNewRef(lane);
    s->tag = Py_XNewRef(tag);
    s->src = Py_XNewRef(src);
    s->dst = Py_XNewRef(dst);
    s->event = Py_XNewRef(event);
    s->sub = NULL;
    s->st = st;
    PyObject_GC_Track(s);
    return (PyObject *)s;
}

static int
step_traverse(StepObject *s, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(s));
    Py_VISIT(s->ub);
    Py_VISIT(s->lane);
    Py_VISIT(s->tag);
    Py_VISIT(s->src);
    Py_VISIT(s->dst);
    Py_VISIT(s->event);
    Py_VISIT(s->sub);
    return 0;
}

static int
step_clear(StepObject *s)
{
    Py_CLEAR(s->ub);
    Py_CLEAR(s->lane);
    Py_CLEAR(s->tag);
    Py_CLEAR(s->src);
    Py_CLEAR(s->dst);
    Py_CLEAR(s->event);
    Py_CLEAR(s->sub);
    return 0;
}

static void
step_dealloc(StepObject *s)
{
    PyTypeObject *tp = Py_TYPE(s);
    State *st = s->st;
    PyObject_GC_UnTrack(s);
    step_clear(s); /* may run code, which may make and free Steps: the list is read after it */
    /* kept only while the module's type is configured and is this one (not after module_clear) */
    if (tp == st->step_type && st->nkept < STEPS_KEPT)
        st->kept[st->nkept++] = (PyObject *)s;
    else
        PyObject_GC_Del(s);
    Py_DECREF(tp);
}

/* Send `value` into the wait: the next value to yield, or NULL (finished: no error; failed). */
static PyObject *
step_delegate(StepObject *s, PyObject *value)
{
    PyObject *sub = Py_NewRef(s->sub), *res = NULL;
    PySendResult r = PyIter_Send(sub, value, &res);
    Py_DECREF(sub);
    if (r == PYGEN_NEXT)
        return res;
    s->state = S_DONE;
    Py_CLEAR(s->sub);
    if (r == PYGEN_RETURN)
        Py_DECREF(res); /* `yield from signal.__await__()` is a statement: its value is dropped */
    return NULL;
}

/* Start waiting on `signal` (Python: `yield from signal.__await__()`). */
static PyObject *
step_wait_on(StepObject *s, PyObject *signal)
{
    PyObject *sub = PyObject_CallMethod(signal, "__await__", NULL);
    if (sub == NULL) {
        s->state = S_DONE;
        return NULL;
    }
    PyObject *it = PyObject_GetIter(sub); /* what `yield from` iterates */
    Py_DECREF(sub);
    if (it == NULL) {
        s->state = S_DONE;
        return NULL;
    }
    Py_XSETREF(s->sub, it);
    s->state = S_WAITING;
    return step_delegate(s, Py_None);
}

/* K_ROLE, up to the yield: ub.unawaited = None; event = lane.events[src]; if event is not None:
 * lane.record(event, lane.streams[src]); ub.tag = tag. 0 or -1. */
static int
role_start(State *st, StepObject *s)
{
    PyObject *event = lane_item(st, s->lane, L_EVENTS, s->src);
    if (event == NULL)
        return -1;
    if (event != Py_None) { /* record before the yield: covers only this ubatch's work */
        PyObject *record = lane_get(st, s->lane, L_RECORD);
        PyObject *stream = record == NULL ? NULL : lane_item(st, s->lane, L_STREAMS, s->src);
        PyObject *r = stream == NULL ? NULL : call2(record, event, stream);
        Py_XDECREF(record);
        Py_XDECREF(stream);
        if (r == NULL) {
            Py_DECREF(event);
            return -1;
        }
        Py_DECREF(r);
    }
    Py_XSETREF(s->event, event);
    return ub_set(st, s->ub, UB_TAG, s->tag);
}

/* K_ROLE, after the yield: enter dst, then wait on the done-event from the stream entered. */
static PyObject *
role_resume(State *st, StepObject *s)
{
    PyObject *stream = enter_role(st, s->ub, s->lane, s->dst);
    if (stream == NULL || s->event == NULL || s->event == Py_None) {
        Py_XDECREF(stream);
        s->state = S_DONE;
        return NULL;
    }
    PyObject *wait = lane_get(st, s->lane, L_WAIT);
    PyObject *event = Py_NewRef(s->event);
    PyObject *signal = wait == NULL ? NULL : call2(wait, stream, event); /* after the resume */
    Py_XDECREF(wait);
    Py_DECREF(event);
    Py_DECREF(stream);
    if (signal == NULL || signal == Py_None) {
        Py_XDECREF(signal);
        s->state = S_DONE;
        return NULL;
    }
    PyObject *r = step_wait_on(s, signal);
    Py_DECREF(signal);
    return r;
}

/* One resume: what the Python generators do. Returns the value to yield, or NULL: finished (no
 * error set) or failed (error set). */
static PyObject *
step_advance(State *st, StepObject *s, PyObject *value)
{
    switch (s->state) {
    case S_START:
        if (value != Py_None) { /* as a generator: the mark stays, nothing ran */
            PyErr_SetString(PyExc_TypeError, "can't send non-None value to a just-started generator");
            return NULL;
        }
        if (ub_set(st, s->ub, UB_UNAWAITED, Py_None) < 0)
            goto fail;
        if (s->kind == K_WAIT) {
            if (s->event == Py_None) {
                s->state = S_DONE;
                return NULL;
            }
            PyObject *signal = Py_NewRef(s->event);
            PyObject *r = step_wait_on(s, signal);
            Py_DECREF(signal);
            return r;
        }
        if (s->kind == K_ROLE && role_start(st, s) < 0)
            goto fail;
        s->state = S_YIELDED;
        return Py_NewRef(st->switch_);
    case S_YIELDED:
        if (s->kind == K_SWITCH) {
            s->state = S_DONE;
            return NULL;
        }
        return role_resume(st, s);
    case S_WAITING:
        return step_delegate(s, value);
    default:
        return NULL;
    }
fail:
    s->state = S_DONE;
    return NULL;
}

static int
step_enter(StepObject *s)
{
    if (s->running) {
        PyErr_SetString(PyExc_ValueError, "generator already executing");
        return -1;
    }
    s->running = 1;
    return 0;
}

/* A StopIteration that escapes a running generator becomes RuntimeError (PEP 479); so it does
 * here, for one raised by what the awaitable calls (a finished wait is not an error). */
static void
pep479(void)
{
    if (!PyErr_Occurred() || !PyErr_ExceptionMatches(PyExc_StopIteration))
        return;
    PyObject *stop = adb_take_exception();
    PyErr_SetString(PyExc_RuntimeError, "generator raised StopIteration");
    PyObject *err = adb_take_exception();
    if (err == NULL) {
        Py_XDECREF(stop);
        return;
    }
    PyException_SetCause(err, Py_NewRef(stop));
    PyException_SetContext(err, stop);
    adb_restore_exception(err);
}

/* send / __next__ / the await protocol's send: one resume under the running guard. */
static PyObject *
step_run(StepObject *s, PyObject *value)
{
    if (step_enter(s) < 0)
        return NULL;
    Py_INCREF(s); /* whatever the resume runs may drop the last other reference */
    int live = s->state != S_DONE;
    PyObject *r = step_advance(s->st, s, value);
    if (r == NULL && live)
        pep479();
    s->running = 0;
    Py_DECREF(s);
    return r;
}

static PyObject *
step_iternext(StepObject *s)
{
    return step_run(s, Py_None);
}

static PySendResult
step_am_send(PyObject *self, PyObject *arg, PyObject **result)
{
    PyObject *r = step_run((StepObject *)self, arg);
    if (r != NULL) {
        *result = r;
        return PYGEN_NEXT;
    }
    if (PyErr_Occurred()) {
        *result = NULL;
        return PYGEN_ERROR;
    }
    *result = Py_NewRef(Py_None);
    return PYGEN_RETURN;
}

static PyObject *
step_send(StepObject *s, PyObject *arg)
{
    PyObject *r = step_run(s, arg);
    if (r == NULL && !PyErr_Occurred())
        PyErr_SetNone(PyExc_StopIteration);
    return r;
}

/* Raise what generator.throw(typ[, val[, tb]]) raises at the suspension point. */
static void
set_thrown(PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *typ = args[0];
    PyObject *val = nargs > 1 && args[1] != Py_None ? args[1] : NULL;
    PyObject *tb = nargs > 2 && args[2] != Py_None ? args[2] : NULL;
    if (tb != NULL && !PyTraceBack_Check(tb)) {
        PyErr_SetString(PyExc_TypeError, "throw() third argument must be a traceback object");
        return;
    }
    if (PyExceptionClass_Check(typ)) {
        PyObject *exc;
        if (val != NULL && PyObject_TypeCheck(val, (PyTypeObject *)typ))
            exc = Py_NewRef(val);
        else if (val == NULL)
            exc = PyObject_CallNoArgs(typ);
        else if (PyTuple_Check(val))
            exc = PyObject_Call(typ, val, NULL);
        else
            exc = PyObject_CallOneArg(typ, val);
        if (exc == NULL)
            return;
        if (!PyExceptionInstance_Check(exc)) {
            PyErr_Format(PyExc_TypeError, "calling %R should have returned an instance of BaseException, not %s",
                         typ, Py_TYPE(exc)->tp_name);
            Py_DECREF(exc);
            return;
        }
        if (tb != NULL && PyException_SetTraceback(exc, tb) < 0) {
            Py_DECREF(exc);
            return;
        }
        adb_restore_exception(exc);
        return;
    }
    if (PyExceptionInstance_Check(typ)) {
        if (val != NULL) {
            PyErr_SetString(PyExc_TypeError, "instance exception may not have a separate value");
            return;
        }
        if (tb != NULL && PyException_SetTraceback(typ, tb) < 0)
            return;
        adb_restore_exception(Py_NewRef(typ));
        return;
    }
    PyErr_Format(PyExc_TypeError, "exceptions must be classes or instances deriving from BaseException, not %s",
                 Py_TYPE(typ)->tp_name);
}

/* Close the wait's iterator (its close(), if it has one), as a generator closes its delegate. */
static int
close_sub(PyObject *sub)
{
    PyObject *meth;
    if (adb_optional_attr(sub, "close", &meth) < 0)
        return -1;
    if (meth == NULL)
        return 0;
    PyObject *r = PyObject_CallNoArgs(meth);
    Py_DECREF(meth);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *
step_throw_running(StepObject *s, PyObject *const *args, Py_ssize_t nargs)
{
    if (s->state == S_WAITING) {
        PyObject *sub = Py_NewRef(s->sub);
        if (PyExceptionClass_Check(args[0]) && PyErr_GivenExceptionMatches(args[0], PyExc_GeneratorExit)) {
            /* a generator closes its delegate, then raises GeneratorExit here */
            s->state = S_DONE;
            Py_CLEAR(s->sub);
            int closed = close_sub(sub);
            Py_DECREF(sub);
            if (closed < 0)
                return NULL;
            set_thrown(args, nargs);
            return NULL;
        }
        PyObject *meth;
        if (adb_optional_attr(sub, "throw", &meth) < 0) {
            Py_DECREF(sub);
            s->state = S_DONE;
            Py_CLEAR(s->sub);
            return NULL;
        }
        Py_DECREF(sub);
        if (meth != NULL) {
            PyObject *r = PyObject_Vectorcall(meth, args, nargs, NULL);
            Py_DECREF(meth);
            if (r != NULL)
                return r;
            /* the wait ended (StopIteration: finished, so does this awaitable) or raised */
            s->state = S_DONE;
            Py_CLEAR(s->sub);
            if (PyErr_ExceptionMatches(PyExc_StopIteration))
                PyErr_Clear();
            return NULL;
        }
        /* no throw(): raised here, as a generator does */
        Py_CLEAR(s->sub);
    }
    s->state = S_DONE; /* raised at the yield (or before the start), as a generator would */
    set_thrown(args, nargs);
    return NULL;
}

static PyObject *
step_throw(StepObject *s, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 3) { /* generator.throw's own two messages */
        PyErr_Format(PyExc_TypeError, nargs < 1 ? "throw expected at least 1 argument, got %zd"
                                                : "throw expected at most 3 arguments, got %zd", nargs);
        return NULL;
    }
    if (step_enter(s) < 0)
        return NULL;
    Py_INCREF(s);
    int live = s->state != S_DONE;
    PyObject *r = step_throw_running(s, args, nargs);
    if (r == NULL && live)
        pep479();
    s->running = 0;
    if (r == NULL && !PyErr_Occurred())
        PyErr_SetNone(PyExc_StopIteration);
    Py_DECREF(s);
    return r;
}

static PyObject *
step_close(StepObject *s, PyObject *Py_UNUSED(ignored))
{
    if (step_enter(s) < 0)
        return NULL;
    Py_INCREF(s);
    PyObject *sub = s->sub;
    s->sub = NULL;
    s->state = S_DONE;
    int closed = sub == NULL ? 0 : close_sub(sub);
    Py_XDECREF(sub);
    s->running = 0;
    Py_DECREF(s);
    if (closed < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
step_self(PyObject *self)
{
    return Py_NewRef(self);
}

static PyObject *
step_get_yieldfrom(StepObject *s, void *Py_UNUSED(closure))
{
    return Py_NewRef(s->sub != NULL ? s->sub : Py_None);
}

static PyObject *
step_get_running(StepObject *s, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(s->running);
}

static PyObject *
step_repr(StepObject *s)
{
    static const char *kinds[] = {"dbo_yield", "yield-and-switch", "switch wait"};
    if (s->tag != NULL)
        return PyUnicode_FromFormat("<asyncdbo %s %R>", kinds[s->kind], s->tag);
    return PyUnicode_FromFormat("<asyncdbo %s>", kinds[s->kind]);
}

static PyMethodDef step_methods[] = {
    {"send", (PyCFunction)step_send, METH_O, NULL},
    {"throw", (PyCFunction)(void (*)(void))step_throw, METH_FASTCALL, NULL},
    {"close", (PyCFunction)step_close, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef step_getset[] = {
    {"gi_yieldfrom", (getter)step_get_yieldfrom, NULL, "what this awaitable waits on now, or None", NULL},
    {"gi_running", (getter)step_get_running, NULL, "whether it is running now", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot step_slots[] = {
    {Py_tp_dealloc, step_dealloc},
    {Py_am_await, step_self},
    {Py_am_send, step_am_send},
    {Py_tp_repr, step_repr},
    {Py_tp_doc, "The awaitable a DBO primitive returns (a state machine instead of a generator)."},
    {Py_tp_traverse, step_traverse},
    {Py_tp_clear, step_clear},
    {Py_tp_iter, step_self},
    {Py_tp_iternext, step_iternext},
    {Py_tp_methods, step_methods},
    {Py_tp_getset, step_getset},
    {0, NULL},
};

static PyType_Spec step_spec = {
    .name = "asyncdbo.dbo._speedups.Step",
    .basicsize = sizeof(StepObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = step_slots,
};

/* ------------------------------------------------------------------ the primitives */

enum { P_YIELD, P_ROLE, P_SYNC, P_PLAIN };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int kind;
    PyObject *pyfunc; /* the Python implementation: the reference, and every uncommon case */
    PyObject *deftag; /* the tag when none is given (P_YIELD, P_ROLE) */
    PyObject *src, *dst;
    PyObject *marks; /* P_YIELD, P_ROLE: the shared marks by tag (a dict); P_SYNC: the mark itself */
#define TAG_CACHED 4
    /* P_YIELD, P_ROLE: the tags looked up in marks last, by identity, and their marks (a layer passes
     * the same few tag objects again and again: no dict lookup then; marks are never replaced) */
    PyObject *tags[TAG_CACHED], *tag_marks[TAG_CACHED];
    int tag_next; /* the entry a miss replaces next */
    Py_ssize_t fallbacks; /* calls that the Python version handled */
    State *st; /* its module's state, read once: it outlives the object (as StepObject's) */
} PrimitiveObject;

/* The checks made before anything changes: an exact UBatch with nothing pending and (where
 * `nodebug`) not in debug mode, whose ext is an exact Lane. Returns the lane (borrowed) or NULL. */
static inline int
fast_ub(State *st, PyObject *ub, int nodebug)
{
    return peek(ub, st->ub[UB_UNAWAITED]) == Py_None && (!nodebug || peek(ub, st->ub[UB_DEBUG]) == Py_None)
        && peek(ub, st->ub[UB_UNAWAITED_AT]) != NULL && peek(ub, st->ub[UB_TAG]) != NULL
        && peek(ub, st->ub[UB_RESUME_WITH]) != NULL;
}

static PyObject *
fast_lane(State *st, PyObject *ub, int nodebug)
{
    PyObject *lane = peek(ub, st->ub[UB_EXT]);
    if (!fast_ub(st, ub, nodebug) || lane == NULL || !Py_IS_TYPE(lane, st->lane_type))
        return NULL;
    return lane;
}

/* ub.unawaited = mark; ub.unawaited_at = (code, lasti) of the caller, in that order, then the
 * release of what they held (Python's order). 0 or -1. */
static int
mark(State *st, PyObject *ub, PyObject *mark_)
{
    PyObject *dropped[2] = {NULL, NULL};
    PyObject *site = caller_site(st, ADB_SLOT(ub, st->ub[UB_UNAWAITED_AT]), dropped);
    if (site == NULL)
        return -1;
    adb_slot_set(ub, st->ub[UB_UNAWAITED], mark_); /* the fast paths run with None there: no code runs */
    PyObject *old = ADB_SLOT(ub, st->ub[UB_UNAWAITED_AT]);
    ADB_SLOT(ub, st->ub[UB_UNAWAITED_AT]) = site;
    Py_XDECREF(old); /* the old pair; where it was refilled, the reference caller_site added */
    Py_XDECREF(dropped[0]);
    Py_XDECREF(dropped[1]);
    return 0;
}

/* Python's _sync_switch past its checks (the mark is set): record on the stream left, enter dst,
 * then the awaitable that waits on the event from the stream entered. */
static PyObject *
sync_switch(State *st, PyObject *ub, PyObject *lane, PyObject *dst)
{
    PyObject *role = lane_get(st, lane, L_ROLE);
    PyObject *event = role == NULL ? NULL : lane_item(st, lane, L_EVENTS, role);
    Py_XDECREF(role);
    if (event == NULL)
        return NULL;
    PyObject *signal = NULL, *stream = NULL, *result = NULL;
    if (event != Py_None) {
        PyObject *record = lane_get(st, lane, L_RECORD);
        PyObject *from = record == NULL ? NULL : lane_get(st, lane, L_STREAM);
        PyObject *r = from == NULL ? NULL : call2(record, event, from);
        Py_XDECREF(record);
        Py_XDECREF(from);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    stream = enter_role(st, ub, lane, dst);
    if (stream == NULL)
        goto done;
    if (event == Py_None)
        signal = Py_NewRef(Py_None);
    else {
        PyObject *wait = lane_get(st, lane, L_WAIT);
        signal = wait == NULL ? NULL : call2(wait, stream, event); /* a failed comm raises when awaited */
        Py_XDECREF(wait);
        if (signal == NULL)
            goto done;
    }
    result = step_new(st, K_WAIT, ub, NULL, NULL, NULL, NULL, signal);
done:
    Py_XDECREF(signal);
    Py_XDECREF(stream);
    Py_DECREF(event);
    return result;
}

/* The mark of `tag` (borrowed: the cache holds it until the next miss), from the cache or from the
 * marks dict (then cached); NULL, with no error set, where the dict has none yet or the lookup
 * raised (the Python version then makes it or raises), or where releasing the entry it replaced
 * ran code that changed the cache (the caller falls back: nothing changed yet). */
static PyObject *
tag_mark(PrimitiveObject *self, PyObject *tag)
{
    for (int i = 0; i < TAG_CACHED; i++)
        if (self->tags[i] == tag)
            return self->tag_marks[i];
    PyObject *m = PyDict_GetItemWithError(self->marks, tag); /* borrowed */
    if (m == NULL) {
        PyErr_Clear();
        return NULL;
    }
    int i = self->tag_next;
    self->tag_next = (i + 1) % TAG_CACHED;
    PyObject *old_tag = self->tags[i], *old_mark = self->tag_marks[i];
    self->tags[i] = Py_NewRef(tag);
    self->tag_marks[i] = Py_NewRef(m);
    Py_XDECREF(old_tag); /* may run code (a str subclass's finalizer)... */
    Py_XDECREF(old_mark);
    if (self->tags[i] != tag) /* ...that called this primitive and replaced the entry */
        return NULL;
    return self->tag_marks[i];
}

static PyObject *
primitive_call(PyObject *self_, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PrimitiveObject *self = (PrimitiveObject *)self_;
    State *st = self->st;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *ub = NULL, *result = NULL, *lane;
    int tagged = self->kind == P_YIELD || self->kind == P_ROLE;
    PyObject *tag = tagged && nargs ? args[0] : self->deftag;
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) { /* only tag=... */
        if (!tagged || nargs != 0 || PyTuple_GET_SIZE(kwnames) != 1
            || PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "tag") != 0)
            goto fallback;
        tag = args[0];
    }
    else if (nargs > (tagged ? 1 : 0))
        goto fallback;
    if (PyContextVar_Get(st->current_ubatch, NULL, &ub) < 0)
        return NULL;
    if (ub == NULL || ub == Py_None) { /* outside a run: every primitive is a no-op */
        Py_XDECREF(ub);
        return Py_NewRef(st->completed);
    }
    if (!Py_IS_TYPE(ub, st->ubatch_type))
        goto fallback;
    Py_INCREF(tag); /* the caller's, but held like everything else used across a call out */

    switch (self->kind) {
    case P_YIELD: { /* Python: ub.unawaited = marks[tag]; ...; ub.tag = tag; return switch(ub) */
        /* the mark first: a miss may run code (see tag_mark), the checks below come after it */
        PyObject *m = tag_mark(self, tag);
        if (m == NULL || !fast_ub(st, ub, 1))
            goto fallback_tag;
        /* the cache holds the mark and nothing runs until mark() stored it (it replaces None) */
        if (mark(st, ub, m) < 0)
            break;
        adb_slot_set(ub, st->ub[UB_TAG], tag);
        result = step_new(st, K_SWITCH, ub, NULL, NULL, NULL, NULL, NULL);
        break;
    }
    case P_ROLE: {
        PyObject *m = tag_mark(self, tag); /* first: a miss may run code (see tag_mark) */
        if (m == NULL || (lane = fast_lane(st, ub, 1)) == NULL)
            goto fallback_tag;
        PyObject *role = peek(lane, st->lane[L_ROLE]);
        if (role != self->src) /* a wrong role (or one equal but not the same object): Python checks */
            goto fallback_tag;
        Py_INCREF(m);
        int ok = mark(st, ub, m) == 0;
        Py_DECREF(m);
        if (ok)
            result = step_new(st, K_ROLE, ub, lane, tag, self->src, self->dst, NULL);
        break;
    }
    case P_SYNC:
        if ((lane = fast_lane(st, ub, 1)) == NULL)
            goto fallback_tag;
        Py_INCREF(lane);
        if (mark(st, ub, self->marks) == 0)
            result = sync_switch(st, ub, lane, self->dst);
        Py_DECREF(lane);
        break;
    case P_PLAIN: { /* Python: lane.role = dst; ...; return COMPLETED (no mark, no debug check) */
        if ((lane = fast_lane(st, ub, 0)) == NULL)
            goto fallback_tag;
        Py_INCREF(lane);
        PyObject *stream = enter_role(st, ub, lane, self->dst);
        Py_DECREF(lane);
        if (stream != NULL) {
            Py_DECREF(stream);
            result = Py_NewRef(st->completed);
        }
        break;
    }
    }
    Py_DECREF(tag);
    Py_DECREF(ub);
    return result;

fallback_tag:
    Py_DECREF(tag);
fallback:
    self->fallbacks++;
    Py_XDECREF(ub);
    return PyObject_Vectorcall(self->pyfunc, args, nargsf, kwnames);
}

static PyObject *
primitive_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"pyfunc", "kind", "tag", "src", "dst", "marks", NULL};
    PyObject *pyfunc, *kind, *tag = Py_None, *src = Py_None, *dst = Py_None, *marks = Py_None;
    /* `kind` is read as the str object it came as, positional or keyword: the error below names it
     * (reading it back from `args` read past the tuple when it came by keyword, issue 48). */
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OU|OOOO:Primitive", kwlist, &pyfunc, &kind, &tag, &src, &dst, &marks))
        return NULL;
    int k;
    /* length-checked (an embedded NUL does not match) and never fails */
    if (PyUnicode_CompareWithASCIIString(kind, "yield") == 0)
        k = P_YIELD;
    else if (PyUnicode_CompareWithASCIIString(kind, "role") == 0)
        k = P_ROLE;
    else if (PyUnicode_CompareWithASCIIString(kind, "sync") == 0)
        k = P_SYNC;
    else if (PyUnicode_CompareWithASCIIString(kind, "plain") == 0)
        k = P_PLAIN;
    else
        return PyErr_Format(PyExc_ValueError, "Primitive kind must be yield, role, sync or plain (got %R)", kind);
    if (!PyCallable_Check(pyfunc))
        return PyErr_Format(PyExc_TypeError, "Primitive needs a callable Python implementation (got %R)", pyfunc);
    if ((k == P_YIELD || k == P_ROLE) && !PyDict_CheckExact(marks))
        return PyErr_Format(PyExc_TypeError, "a %s primitive needs its marks dict (got %R)",
                            k == P_YIELD ? "yield" : "role", marks);
    State *st = state_of_type(type);
    if (st == NULL)
        return NULL;
    if (st->current_ubatch == NULL)
        return PyErr_Format(PyExc_RuntimeError, "asyncdbo.dbo._speedups.configure() was not called");
    PrimitiveObject *p = (PrimitiveObject *)type->tp_alloc(type, 0);
    if (p == NULL)
        return NULL;
    p->vectorcall = primitive_call;
    p->st = st;
    p->kind = k;
    p->pyfunc = Py_NewRef(pyfunc);
    p->deftag = Py_NewRef(tag);
    p->src = Py_NewRef(src);
    p->dst = Py_NewRef(dst);
    p->marks = Py_NewRef(marks);
    for (int i = 0; i < TAG_CACHED; i++)
        p->tags[i] = p->tag_marks[i] = NULL;
    p->tag_next = 0;
    p->fallbacks = 0;
    return (PyObject *)p;
}

static int
primitive_traverse(PrimitiveObject *p, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(p));
    Py_VISIT(p->pyfunc);
    Py_VISIT(p->deftag);
    Py_VISIT(p->src);
    Py_VISIT(p->dst);
    Py_VISIT(p->marks);
    for (int i = 0; i < TAG_CACHED; i++) {
        Py_VISIT(p->tags[i]);
        Py_VISIT(p->tag_marks[i]);
    }
    return 0;
}

static int
primitive_clear(PrimitiveObject *p)
{
    Py_CLEAR(p->pyfunc);
    Py_CLEAR(p->deftag);
    Py_CLEAR(p->src);
    Py_CLEAR(p->dst);
    Py_CLEAR(p->marks);
    for (int i = 0; i < TAG_CACHED; i++) {
        Py_CLEAR(p->tags[i]);
        Py_CLEAR(p->tag_marks[i]);
    }
    return 0;
}

static void
primitive_dealloc(PrimitiveObject *p)
{
    PyTypeObject *tp = Py_TYPE(p);
    PyObject_GC_UnTrack(p);
    primitive_clear(p);
    tp->tp_free((PyObject *)p);
    Py_DECREF(tp);
}

/* Introspection reads the Python implementation: its name, docstring, signature (through
 * __wrapped__, as inspect.signature follows it) and module. */
static PyObject *
primitive_getattro(PyObject *self, PyObject *name)
{
    /* the type's own __module__ (a heap type's, in its dict) would shadow the function's */
    int is_module = PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "__module__") == 0;
    PyObject *r = is_module ? NULL : PyObject_GenericGetAttr(self, name);
    if (is_module)
        PyErr_SetNone(PyExc_AttributeError);
    if (r != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return r;
    PyErr_Clear();
    PyObject *pyfunc = Py_NewRef(((PrimitiveObject *)self)->pyfunc);
    r = PyObject_GetAttr(pyfunc, name);
    Py_DECREF(pyfunc);
    return r;
}

/* Stored as a class attribute, it binds like the Python function it stands for. */
static PyObject *
primitive_descr_get(PyObject *self, PyObject *obj, PyObject *Py_UNUSED(type))
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *
primitive_get_wrapped(PrimitiveObject *p, void *Py_UNUSED(closure))
{
    return Py_NewRef(p->pyfunc);
}

static PyObject *
primitive_get_doc(PrimitiveObject *p, void *Py_UNUSED(closure))
{
    PyObject *pyfunc = Py_NewRef(p->pyfunc);
    PyObject *r = PyObject_GetAttrString(pyfunc, "__doc__");
    Py_DECREF(pyfunc);
    return r;
}

static PyObject *
primitive_repr(PrimitiveObject *p)
{
    return PyUnicode_FromFormat("<asyncdbo primitive %R (C fast path)>", p->pyfunc);
}

static PyGetSetDef primitive_getset[] = {
    {"__wrapped__", (getter)primitive_get_wrapped, NULL, "the Python implementation", NULL},
    {"__doc__", (getter)primitive_get_doc, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef primitive_members[] = {
    {"fallbacks", T_PYSSIZET, offsetof(PrimitiveObject, fallbacks), 0,
     "calls that the Python version handled (a pending mark, debug mode, a tag used for the first time, ...)"},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(PrimitiveObject, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot primitive_slots[] = {
    {Py_tp_dealloc, primitive_dealloc},
    {Py_tp_repr, primitive_repr},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_getattro, primitive_getattro},
    {Py_tp_descr_get, primitive_descr_get},
    {Py_tp_traverse, primitive_traverse},
    {Py_tp_clear, primitive_clear},
    {Py_tp_getset, primitive_getset},
    {Py_tp_members, primitive_members},
    {Py_tp_new, primitive_new},
    {0, NULL},
};

static PyType_Spec primitive_spec = {
    .name = "asyncdbo.dbo._speedups.Primitive",
    .basicsize = sizeof(PrimitiveObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = primitive_slots,
};

/* ------------------------------------------------------------------ module */

/* configure(current_ubatch, UBatch, Lane, SWITCH, COMPLETED). All or nothing: any error leaves the
 * previous configuration (or none) in place. */
static PyObject *
configure(PyObject *module, PyObject *args)
{
    PyObject *var, *switch_, *completed;
    PyTypeObject *ubt, *lanet;
    if (!PyArg_ParseTuple(args, "O!O!O!OO:configure", &PyContextVar_Type, &var, &PyType_Type, &ubt, &PyType_Type,
                          &lanet, &switch_, &completed))
        return NULL;
    State *st = PyModule_GetState(module);
    if (st == NULL)
        return NULL;
    Py_ssize_t ub[UB_NSLOTS], lane[L_NSLOTS];
    if (adb_member_offsets(ubt, ub_names, ub, UB_NSLOTS) < 0 || adb_member_offsets(lanet, lane_names, lane, L_NSLOTS) < 0)
        return NULL;
    /* commit, with no call out in between (the old references are dropped after) */
    PyObject *old[5] = {st->current_ubatch, (PyObject *)st->ubatch_type, (PyObject *)st->lane_type, st->switch_,
                        st->completed};
    memcpy(st->ub, ub, sizeof ub);
    memcpy(st->lane, lane, sizeof lane);
    st->current_ubatch = Py_NewRef(var);
    st->ubatch_type = (PyTypeObject *)Py_NewRef(ubt);
    st->lane_type = (PyTypeObject *)Py_NewRef(lanet);
    st->switch_ = Py_NewRef(switch_);
    st->completed = Py_NewRef(completed);
    for (int i = 0; i < 5; i++)
        Py_XDECREF(old[i]);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(current_ubatch, UBatch, Lane, SWITCH, COMPLETED): what the fast paths read and return."},
    {NULL, NULL, 0, NULL},
};

static int
module_exec(PyObject *m)
{
    State *st = PyModule_GetState(m);
    st->step_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &step_spec, NULL);
    if (st->step_type == NULL || PyModule_AddObjectRef(m, "Step", (PyObject *)st->step_type) < 0)
        return -1;
    st->primitive_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &primitive_spec, NULL);
    if (st->primitive_type == NULL || PyModule_AddObjectRef(m, "Primitive", (PyObject *)st->primitive_type) < 0)
        return -1;
    return 0;
}

static int
module_traverse(PyObject *m, visitproc visit, void *arg)
{
    State *st = PyModule_GetState(m);
    if (st == NULL)
        return 0;
    Py_VISIT(st->step_type);
    Py_VISIT(st->primitive_type);
    Py_VISIT(st->current_ubatch);
    Py_VISIT(st->ubatch_type);
    Py_VISIT(st->lane_type);
    Py_VISIT(st->switch_);
    Py_VISIT(st->completed);
    return 0;
}

static int
module_clear(PyObject *m)
{
    State *st = PyModule_GetState(m);
    if (st == NULL)
        return 0;
    Py_CLEAR(st->step_type);
    Py_CLEAR(st->primitive_type);
    Py_CLEAR(st->current_ubatch);
    Py_CLEAR(st->ubatch_type);
    Py_CLEAR(st->lane_type);
    Py_CLEAR(st->switch_);
    Py_CLEAR(st->completed);
    for (int i = 0; i < LASTI_CACHED; i++) /* ints: not in a cycle, not visited */
        Py_CLEAR(st->lasti[i]);
    while (st->nkept > 0) { /* freed Steps: memory only (no reference held, not tracked) */
        PyObject *s = st->kept[--st->nkept];
        st->kept[st->nkept] = NULL;
        PyObject_GC_Del(s);
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
    /* Thread safety: this module relies on the GIL. The primitives and their awaitables read and
     * write slots of a run's records (UBatch, Lane) with plain loads and stores and keep borrowed
     * pointers between a check and its use; that is safe only while no other thread can touch
     * those records at the same time. The kernel drives a run on one thread, but a user's thread
     * may still touch a record: under the GIL that is merely wrong, without it it could free an
     * object under us. On a free-threaded build asyncdbo does not load the extensions while the
     * GIL is disabled (asyncdbo/_core/extensions.py), so the Python primitives run there. */
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "asyncdbo.dbo._speedups",
    .m_doc = "C fast paths of the DBO primitives; asyncdbo.dbo.primitives is the reference.",
    .m_size = sizeof(State),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModuleDef_Init(&speedups_module);
}
