/* C fast paths of the DBO yield and switch primitives (asyncdbo/dbo/primitives.py).
 *
 * Why: a yield primitive in Python is a call, a generator object and two frames per yield; the
 * `ht` layer calls six of them for its three yields. In pure Python its eager step took 0.6-1.5 us
 * of host time per yield, with these paths and the kernel's C loop 148-250 ns
 * (benchmarks/host_overhead.py, results of 2026-12-01 runs 5-6). Here each primitive is a
 * vectorcall object and the awaitable it returns is a small iterator with a state machine instead
 * of a generator frame.
 *
 * The contract: Python stays the reference. A Primitive handles only the common case (a plain
 * positional call inside a run, nothing pending, not in debug mode, the ubatch on the expected
 * role, a known tag) and before it changes anything it checks all of that; anything else (a
 * keyword other than tag=, a missing await to report, debug mode, a wrong role, an unknown tag, a
 * lane of another type) calls the Python implementation with the same arguments, which raises the
 * same errors as always. tests/dbo/test_speedups.py runs the same programs on both and compares
 * whole traces.
 *
 * The records it touches (UBatch, Lane) are __slots__ classes: their fields are read and written
 * at the slot offsets read off the member descriptors at configure() time, for exact instances of
 * the configured types only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* ------------------------------------------------------------------ configuration */

static PyObject *g_current_ubatch; /* the contextvar holding the running UBatch */
static PyTypeObject *g_ubatch_type, *g_lane_type;
static PyObject *g_switch;    /* the kernel's SWITCH request */
static PyObject *g_completed; /* the shared done awaitable */
static Py_ssize_t ub_unawaited, ub_debug, ub_ext, ub_tag, ub_resume_with;
static Py_ssize_t lane_role, lane_stream, lane_streams, lane_events, lane_record, lane_wait, lane_install;
static PyObject *s_await, *s_throw, *s_close;

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

static inline void
slot_set(PyObject *obj, Py_ssize_t off, PyObject *value)
{
    PyObject *old = SLOT(obj, off);
    Py_INCREF(value);
    SLOT(obj, off) = value;
    Py_XDECREF(old);
}

static int
member_offset(PyTypeObject *tp, const char *name, Py_ssize_t *off)
{
    PyObject *d = PyObject_GetAttrString((PyObject *)tp, name);
    if (d == NULL)
        return -1;
    if (!Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a __slots__ field", tp->tp_name, name);
        Py_DECREF(d);
        return -1;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if (m->type != T_OBJECT_EX) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not an object slot", tp->tp_name, name);
        Py_DECREF(d);
        return -1;
    }
    *off = m->offset;
    Py_DECREF(d);
    return 0;
}

/* fn(a, b) by vectorcall (the backend's record and wait). */
static inline PyObject *
call2(PyObject *fn, PyObject *a, PyObject *b)
{
    PyObject *args[3] = {NULL, a, b};
    return PyObject_Vectorcall(fn, args + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* mapping[key] as a new reference; a plain dict without the generic call. */
static inline PyObject *
dict_item(PyObject *mapping, PyObject *key)
{
    if (PyDict_CheckExact(mapping)) {
        PyObject *v = PyDict_GetItemWithError(mapping, key);
        if (v != NULL)
            return Py_NewRef(v);
        if (!PyErr_Occurred()) {
            PyObject *args = PyTuple_Pack(1, key); /* KeyError(key), even for a tuple key */
            if (args != NULL) {
                PyErr_SetObject(PyExc_KeyError, args);
                Py_DECREF(args);
            }
        }
        return NULL;
    }
    return PyObject_GetItem(mapping, key);
}

/* The run's install(stream), bound on the lane once per run (None: nothing to install). */
static int
install_stream(PyObject *lane, PyObject *stream)
{
    PyObject *install = SLOT(lane, lane_install);
    if (install == NULL || install == Py_None)
        return 0;
    PyObject *r = PyObject_CallOneArg(install, stream);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* ------------------------------------------------------------------ the awaitable */

enum { K_SWITCH, K_ROLE, K_WAIT };        /* dbo_yield, a yield-and-switch, a sync switch's wait */
enum { S_START, S_YIELDED, S_WAITING, S_DONE };

typedef struct {
    PyObject_HEAD
    int kind, state;
    PyObject *ub, *lane, *tag, *src, *dst;
    PyObject *event; /* K_ROLE: the src done-event (after the yield); K_WAIT: the signal or NULL */
    PyObject *sub;   /* S_WAITING: the signal's __await__ iterator */
} StepObject;

static PyTypeObject Step_Type;

static PyObject *
step_new(int kind, PyObject *ub, PyObject *lane, PyObject *tag, PyObject *src, PyObject *dst, PyObject *event)
{
    StepObject *s = PyObject_GC_New(StepObject, &Step_Type);
    if (s == NULL)
        return NULL;
    s->kind = kind;
    s->state = S_START;
    s->ub = Py_XNewRef(ub);
    s->lane = Py_XNewRef(lane);
    s->tag = Py_XNewRef(tag);
    s->src = Py_XNewRef(src);
    s->dst = Py_XNewRef(dst);
    s->event = Py_XNewRef(event);
    s->sub = NULL;
    PyObject_GC_Track(s);
    return (PyObject *)s;
}

static int
step_traverse(StepObject *s, visitproc visit, void *arg)
{
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
    PyObject_GC_UnTrack(s);
    step_clear(s);
    PyObject_GC_Del(s);
}

/* Start waiting on `signal` (its __await__ iterator), then run it with `value`. */
static PyObject *step_delegate(StepObject *s, PyObject *value);

static PyObject *
step_wait_on(StepObject *s, PyObject *signal)
{
    PyObject *sub = PyObject_CallMethodNoArgs(signal, s_await);
    if (sub == NULL) {
        s->state = S_DONE;
        return NULL;
    }
    s->sub = sub;
    s->state = S_WAITING;
    return step_delegate(s, Py_None);
}

static PyObject *
step_delegate(StepObject *s, PyObject *value)
{
    PyObject *res = NULL;
    PySendResult r = PyIter_Send(s->sub, value, &res);
    if (r == PYGEN_NEXT)
        return res;
    s->state = S_DONE;
    Py_CLEAR(s->sub);
    if (r == PYGEN_RETURN)
        Py_DECREF(res); /* the signal's await returns None; so does this awaitable */
    return NULL;
}

/* Resume: what the Python generators do (_yield_and_switch, switch, _then_wait). Returns the
 * value to yield, or NULL: finished (no error set) or failed (error set). */
static PyObject *
step_advance(StepObject *s, PyObject *value)
{
    switch (s->state) {
    case S_START:
        slot_set(s->ub, ub_unawaited, Py_None);
        if (s->kind == K_WAIT) {
            if (s->event == NULL || s->event == Py_None) {
                s->state = S_DONE;
                return NULL;
            }
            return step_wait_on(s, s->event);
        }
        if (s->kind == K_ROLE) {
            PyObject *event = dict_item(SLOT(s->lane, lane_events), s->src);
            if (event == NULL) {
                s->state = S_DONE;
                return NULL;
            }
            if (event != Py_None) { /* record before the yield: covers only this ubatch's work */
                PyObject *stream = dict_item(SLOT(s->lane, lane_streams), s->src);
                PyObject *r = stream == NULL ? NULL
                    : call2(SLOT(s->lane, lane_record), event, stream);
                Py_XDECREF(stream);
                if (r == NULL) {
                    Py_DECREF(event);
                    s->state = S_DONE;
                    return NULL;
                }
                Py_DECREF(r);
            }
            Py_XSETREF(s->event, event);
            if (Py_IS_TYPE(s->ub, g_ubatch_type))
                slot_set(s->ub, ub_tag, s->tag);
            else if (PyObject_SetAttrString(s->ub, "tag", s->tag) < 0) { /* its class was switched since */
                s->state = S_DONE;
                return NULL;
            }
        }
        s->state = S_YIELDED;
        return Py_NewRef(g_switch);
    case S_YIELDED: {
        if (s->kind == K_SWITCH) {
            s->state = S_DONE;
            return NULL;
        }
        PyObject *lane = s->lane, *ub = s->ub;
        slot_set(lane, lane_role, s->dst);
        PyObject *stream = dict_item(SLOT(lane, lane_streams), s->dst);
        if (stream == NULL) {
            s->state = S_DONE;
            return NULL;
        }
        slot_set(lane, lane_stream, stream);
        slot_set(ub, ub_resume_with, stream);
        if (install_stream(lane, stream) < 0) {
            Py_DECREF(stream);
            s->state = S_DONE;
            return NULL;
        }
        if (s->event == NULL || s->event == Py_None) {
            Py_DECREF(stream);
            s->state = S_DONE;
            return NULL;
        }
        /* after the resume: the stream it enters waits on the done-event */
        PyObject *signal = call2(SLOT(lane, lane_wait), stream, s->event);
        Py_DECREF(stream);
        if (signal == NULL) {
            s->state = S_DONE;
            return NULL;
        }
        if (signal == Py_None) {
            Py_DECREF(signal);
            s->state = S_DONE;
            return NULL;
        }
        PyObject *r = step_wait_on(s, signal);
        Py_DECREF(signal);
        return r;
    }
    case S_WAITING:
        return step_delegate(s, value);
    default:
        return NULL;
    }
}

static PyObject *
step_iternext(StepObject *s)
{
    return step_advance(s, Py_None);
}

static PySendResult
step_am_send(PyObject *self, PyObject *arg, PyObject **result)
{
    PyObject *r = step_advance((StepObject *)self, arg);
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
    PyObject *r = step_advance(s, arg);
    if (r == NULL && !PyErr_Occurred())
        PyErr_SetNone(PyExc_StopIteration);
    return r;
}

/* Raise what generator.throw(typ[, val[, tb]]) would raise at the suspension point. */
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
        Py_INCREF(typ);
        Py_XINCREF(val);
        Py_XINCREF(tb);
        PyErr_NormalizeException(&typ, &val, &tb);
        if (tb != NULL && val != NULL)
            PyException_SetTraceback(val, tb);
        PyErr_Restore(typ, val, tb);
        return;
    }
    if (PyExceptionInstance_Check(typ)) {
        if (val != NULL) {
            PyErr_SetString(PyExc_TypeError, "instance exception may not have a separate value");
            return;
        }
        val = typ;
        typ = (PyObject *)Py_TYPE(val);
        tb = tb != NULL ? Py_NewRef(tb) : PyException_GetTraceback(val);
        PyErr_Restore(Py_NewRef(typ), Py_NewRef(val), tb);
        return;
    }
    PyErr_Format(PyExc_TypeError, "exceptions must be classes or instances deriving from BaseException, not %s",
                 Py_TYPE(typ)->tp_name);
}

static PyObject *
step_throw(StepObject *s, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 3) {
        PyErr_Format(PyExc_TypeError, "throw expected 1 to 3 arguments, got %zd", nargs);
        return NULL;
    }
    if (s->state == S_WAITING) {
        PyObject *meth = PyObject_GetAttr(s->sub, s_throw);
        PyObject *r = meth == NULL ? NULL : PyObject_Vectorcall(meth, args, nargs, NULL);
        Py_XDECREF(meth);
        if (r != NULL)
            return r;
        s->state = S_DONE; /* StopIteration: the wait finished, and so did this awaitable */
        Py_CLEAR(s->sub);
        return NULL;
    }
    s->state = S_DONE; /* raised at the yield (or before the start), as a generator would */
    set_thrown(args, nargs);
    return NULL;
}

static PyObject *
step_close(StepObject *s, PyObject *Py_UNUSED(ignored))
{
    PyObject *sub = s->sub;
    s->sub = NULL;
    s->state = S_DONE;
    if (sub != NULL) {
        PyObject *r = PyObject_CallMethodNoArgs(sub, s_close);
        Py_DECREF(sub);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
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
    {NULL, NULL, NULL, NULL, NULL},
};

static PyAsyncMethods step_as_async = {
    .am_await = step_self,
    .am_send = step_am_send,
};

static PyTypeObject Step_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "asyncdbo.dbo._speedups.Step",
    .tp_basicsize = sizeof(StepObject),
    .tp_dealloc = (destructor)step_dealloc,
    .tp_as_async = &step_as_async,
    .tp_repr = (reprfunc)step_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The awaitable a DBO primitive returns (a state machine instead of a generator).",
    .tp_traverse = (traverseproc)step_traverse,
    .tp_clear = (inquiry)step_clear,
    .tp_iter = step_self,
    .tp_iternext = (iternextfunc)step_iternext,
    .tp_methods = step_methods,
    .tp_getset = step_getset,
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
    PyObject *marks; /* P_ROLE: the shared marks by tag (a dict); P_SYNC: the mark itself */
    Py_ssize_t fallbacks; /* calls that the Python version handled */
} PrimitiveObject;

/* The stream `role` of `lane` after the checks of the caller; NULL (no error) if it has none. */
static PyObject *
lane_stream_of(PyObject *lane, PyObject *role)
{
    PyObject *streams = SLOT(lane, lane_streams);
    if (streams == NULL || !PyDict_CheckExact(streams))
        return NULL;
    PyObject *stream = PyDict_GetItemWithError(streams, role);
    if (stream == NULL)
        PyErr_Clear();
    return stream;
}

/* Make `stream` the lane's current stream (Lane.set_stream, with lane.role = role). 0 or -1. */
static int
enter_stream(PyObject *ub, PyObject *lane, PyObject *role, PyObject *stream)
{
    slot_set(lane, lane_role, role);
    slot_set(lane, lane_stream, stream);
    slot_set(ub, ub_resume_with, stream);
    return install_stream(lane, stream);
}

static PyObject *
primitive_call(PyObject *self_, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PrimitiveObject *self = (PrimitiveObject *)self_;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *ub = NULL, *result = NULL;
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
    if (PyContextVar_Get(g_current_ubatch, NULL, &ub) < 0)
        return NULL;
    if (ub == NULL || ub == Py_None) { /* outside a run: every primitive is a no-op */
        Py_XDECREF(ub);
        return Py_NewRef(g_completed);
    }
    if (!Py_IS_TYPE(ub, g_ubatch_type) || SLOT(ub, ub_unawaited) != Py_None)
        goto fallback;
    PyObject *lane = SLOT(ub, ub_ext);

    switch (self->kind) {
    case P_YIELD:
        if (SLOT(ub, ub_debug) != Py_None)
            goto fallback;
        slot_set(ub, ub_unawaited, tag);
        slot_set(ub, ub_tag, tag);
        result = step_new(K_SWITCH, ub, NULL, NULL, NULL, NULL, NULL);
        break;
    case P_ROLE: {
        if (SLOT(ub, ub_debug) != Py_None || lane == NULL || !Py_IS_TYPE(lane, g_lane_type)
            || SLOT(lane, lane_role) != self->src || !PyDict_CheckExact(SLOT(lane, lane_events)))
            goto fallback;
        PyObject *mark = PyDict_GetItemWithError(self->marks, tag);
        if (mark == NULL) { /* not made yet (or unhashable): Python makes it (or raises) */
            PyErr_Clear();
            goto fallback;
        }
        slot_set(ub, ub_unawaited, mark);
        result = step_new(K_ROLE, ub, lane, tag, self->src, self->dst, NULL);
        break;
    }
    case P_SYNC: {
        if (SLOT(ub, ub_debug) != Py_None || lane == NULL || !Py_IS_TYPE(lane, g_lane_type))
            goto fallback;
        PyObject *events = SLOT(lane, lane_events), *role = SLOT(lane, lane_role), *from = SLOT(lane, lane_stream);
        if (events == NULL || !PyDict_CheckExact(events) || role == NULL || from == NULL)
            goto fallback;
        PyObject *event = PyDict_GetItemWithError(events, role);
        PyObject *stream = lane_stream_of(lane, self->dst);
        if (event == NULL || stream == NULL) {
            PyErr_Clear();
            goto fallback;
        }
        Py_INCREF(event);
        Py_INCREF(stream);
        slot_set(ub, ub_unawaited, self->marks);
        PyObject *signal = NULL;
        int ok = 1;
        if (event != Py_None) {
            PyObject *r = call2(SLOT(lane, lane_record), event, from);
            ok = r != NULL;
            Py_XDECREF(r);
        }
        if (ok)
            ok = enter_stream(ub, lane, self->dst, stream) == 0;
        if (ok && event != Py_None) {
            signal = call2(SLOT(lane, lane_wait), stream, event);
            ok = signal != NULL;
        }
        if (ok)
            result = step_new(K_WAIT, ub, NULL, NULL, NULL, NULL, signal);
        Py_XDECREF(signal);
        Py_DECREF(event);
        Py_DECREF(stream);
        break;
    }
    case P_PLAIN: {
        if (lane == NULL || !Py_IS_TYPE(lane, g_lane_type))
            goto fallback;
        PyObject *stream = lane_stream_of(lane, self->dst);
        if (stream == NULL)
            goto fallback;
        Py_INCREF(stream);
        if (enter_stream(ub, lane, self->dst, stream) == 0)
            result = Py_NewRef(g_completed);
        Py_DECREF(stream);
        break;
    }
    }
    Py_DECREF(ub);
    return result;

fallback:
    self->fallbacks++;
    Py_XDECREF(ub);
    return PyObject_Vectorcall(self->pyfunc, args, nargsf, kwnames);
}

static PyObject *
primitive_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"pyfunc", "kind", "tag", "src", "dst", "marks", NULL};
    PyObject *pyfunc, *tag = Py_None, *src = Py_None, *dst = Py_None, *marks = Py_None;
    const char *kind;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Os|OOOO:Primitive", kwlist, &pyfunc, &kind, &tag, &src, &dst, &marks))
        return NULL;
    int k;
    if (strcmp(kind, "yield") == 0)
        k = P_YIELD;
    else if (strcmp(kind, "role") == 0)
        k = P_ROLE;
    else if (strcmp(kind, "sync") == 0)
        k = P_SYNC;
    else if (strcmp(kind, "plain") == 0)
        k = P_PLAIN;
    else
        return PyErr_Format(PyExc_ValueError, "Primitive kind must be yield, role, sync or plain (got %R)", PyTuple_GET_ITEM(args, 1));
    if (!PyCallable_Check(pyfunc))
        return PyErr_Format(PyExc_TypeError, "Primitive needs a callable Python implementation (got %R)", pyfunc);
    if (k == P_ROLE && !PyDict_CheckExact(marks))
        return PyErr_Format(PyExc_TypeError, "a role primitive needs its marks dict (got %R)", marks);
    if (g_current_ubatch == NULL)
        return PyErr_Format(PyExc_RuntimeError, "asyncdbo.dbo._speedups.configure() was not called");
    PrimitiveObject *p = (PrimitiveObject *)type->tp_alloc(type, 0);
    if (p == NULL)
        return NULL;
    p->vectorcall = primitive_call;
    p->kind = k;
    p->pyfunc = Py_NewRef(pyfunc);
    p->deftag = Py_NewRef(tag);
    p->src = Py_NewRef(src);
    p->dst = Py_NewRef(dst);
    p->marks = Py_NewRef(marks);
    p->fallbacks = 0;
    return (PyObject *)p;
}

static int
primitive_traverse(PrimitiveObject *p, visitproc visit, void *arg)
{
    Py_VISIT(p->pyfunc);
    Py_VISIT(p->deftag);
    Py_VISIT(p->src);
    Py_VISIT(p->dst);
    Py_VISIT(p->marks);
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
    return 0;
}

static void
primitive_dealloc(PrimitiveObject *p)
{
    PyObject_GC_UnTrack(p);
    primitive_clear(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* Introspection reads the Python implementation: its name, docstring, signature (through
 * __wrapped__, as inspect.signature follows it) and module. */
static PyObject *
primitive_getattro(PyObject *self, PyObject *name)
{
    PyObject *r = PyObject_GenericGetAttr(self, name);
    if (r != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return r;
    PyErr_Clear();
    return PyObject_GetAttr(((PrimitiveObject *)self)->pyfunc, name);
}

static PyObject *
primitive_get_wrapped(PrimitiveObject *p, void *Py_UNUSED(closure))
{
    return Py_NewRef(p->pyfunc);
}

static PyObject *
primitive_get_doc(PrimitiveObject *p, void *Py_UNUSED(closure))
{
    return PyObject_GetAttrString(p->pyfunc, "__doc__");
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
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject Primitive_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "asyncdbo.dbo._speedups.Primitive",
    .tp_basicsize = sizeof(PrimitiveObject),
    .tp_dealloc = (destructor)primitive_dealloc,
    .tp_vectorcall_offset = offsetof(PrimitiveObject, vectorcall),
    .tp_repr = (reprfunc)primitive_repr,
    .tp_call = PyVectorcall_Call,
    .tp_getattro = primitive_getattro,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_traverse = (traverseproc)primitive_traverse,
    .tp_clear = (inquiry)primitive_clear,
    .tp_getset = primitive_getset,
    .tp_members = primitive_members,
    .tp_new = primitive_new,
};

/* ------------------------------------------------------------------ module */

static PyObject *
configure(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *var, *switch_, *completed;
    PyTypeObject *ubt, *lanet;
    if (!PyArg_ParseTuple(args, "O!O!O!OO:configure", &PyContextVar_Type, &var, &PyType_Type, &ubt, &PyType_Type,
                          &lanet, &switch_, &completed))
        return NULL;
    if (member_offset(ubt, "unawaited", &ub_unawaited) || member_offset(ubt, "debug", &ub_debug)
        || member_offset(ubt, "ext", &ub_ext) || member_offset(ubt, "tag", &ub_tag)
        || member_offset(ubt, "resume_with", &ub_resume_with)
        || member_offset(lanet, "role", &lane_role) || member_offset(lanet, "stream", &lane_stream)
        || member_offset(lanet, "streams", &lane_streams) || member_offset(lanet, "events", &lane_events)
        || member_offset(lanet, "record", &lane_record) || member_offset(lanet, "wait", &lane_wait)
        || member_offset(lanet, "install", &lane_install))
        return NULL;
    Py_XSETREF(g_current_ubatch, Py_NewRef(var));
    Py_XSETREF(g_ubatch_type, (PyTypeObject *)Py_NewRef(ubt));
    Py_XSETREF(g_lane_type, (PyTypeObject *)Py_NewRef(lanet));
    Py_XSETREF(g_switch, Py_NewRef(switch_));
    Py_XSETREF(g_completed, Py_NewRef(completed));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(current_ubatch, UBatch, Lane, SWITCH, COMPLETED): what the fast paths read and return."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "asyncdbo.dbo._speedups",
    .m_doc = "C fast paths of the DBO primitives; asyncdbo.dbo.primitives is the reference.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    if (PyType_Ready(&Step_Type) < 0 || PyType_Ready(&Primitive_Type) < 0)
        return NULL;
    if ((s_await = PyUnicode_InternFromString("__await__")) == NULL
        || (s_throw = PyUnicode_InternFromString("throw")) == NULL
        || (s_close = PyUnicode_InternFromString("close")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&speedups_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Step", (PyObject *)&Step_Type) < 0
        || PyModule_AddObjectRef(m, "Primitive", (PyObject *)&Primitive_Type) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
