/* Shared by asyncdbo's C extensions (asyncdbo/_core/_spin.c, asyncdbo/dbo/_speedups.c): reading
 * and writing the object fields of __slots__ classes at their slot offsets, safely, and the
 * current-exception API across the supported Python versions.
 *
 * The contract with the Python classes (asyncdbo._core.UBatch, asyncdbo.dbo.state.Lane):
 * - an offset is taken from a member descriptor of the type itself or of one of its bases
 *   (PyDescr_TYPE), for an object slot (T_OBJECT_EX) only, so it is valid for every instance whose
 *   type is exactly the configured type (a __class__ assignment keeps the slot layout);
 * - a caller reads slots only after checking the exact type (Py_IS_TYPE), and re-checks it after
 *   any call out to Python, which may have reassigned __class__;
 * - a slot that was deleted (NULL) is read through the attribute, which raises what Python raises
 *   (AttributeError, with Python's own message).
 */
#ifndef ASYNCDBO_NATIVE_SLOTS_H
#define ASYNCDBO_NATIVE_SLOTS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#define ADB_SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

/* The offset of `tp`'s object slot `name` into *off; -1 with TypeError (or the lookup's error) if
 * `name` is not an object slot of `tp` or of one of its bases. *off is written on success only. */
static int
adb_member_offset(PyTypeObject *tp, const char *name, Py_ssize_t *off)
{
    PyObject *d = PyObject_GetAttrString((PyObject *)tp, name);
    if (d == NULL)
        return -1;
    if (!Py_IS_TYPE(d, &PyMemberDescr_Type) || !PyType_IsSubtype(tp, PyDescr_TYPE(d))) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a __slots__ field of %s", tp->tp_name, name, tp->tp_name);
        Py_DECREF(d);
        return -1;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if (m->type != T_OBJECT_EX || (m->flags & READONLY) || m->offset < (Py_ssize_t)sizeof(PyObject)
        || m->offset + (Py_ssize_t)sizeof(PyObject *) > tp->tp_basicsize) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a writable object __slots__ field", tp->tp_name, name);
        Py_DECREF(d);
        return -1;
    }
    *off = m->offset;
    Py_DECREF(d);
    return 0;
}

/* Offsets of `n` slots, all or nothing: `out` is written only when every name resolved. */
static int
adb_member_offsets(PyTypeObject *tp, const char *const *names, Py_ssize_t *out, int n)
{
    Py_ssize_t tmp[32];
    if (n > 32) {
        PyErr_SetString(PyExc_SystemError, "adb_member_offsets: too many slots");
        return -1;
    }
    for (int i = 0; i < n; i++)
        if (adb_member_offset(tp, names[i], &tmp[i]) < 0)
            return -1;
    memcpy(out, tmp, sizeof(Py_ssize_t) * (size_t)n);
    return 0;
}

/* obj.<name> read at its slot, as a new reference; a deleted slot raises Python's AttributeError
 * (through the attribute, so the message is Python's own). */
static inline PyObject *
adb_slot_get(PyObject *obj, Py_ssize_t off, const char *name)
{
    PyObject *v = ADB_SLOT(obj, off);
    if (v != NULL)
        return Py_NewRef(v);
    return PyObject_GetAttrString(obj, name);
}

/* obj.<name> = value at its slot (what the member descriptor does). */
static inline void
adb_slot_set(PyObject *obj, Py_ssize_t off, PyObject *value)
{
    PyObject *old = ADB_SLOT(obj, off);
    ADB_SLOT(obj, off) = Py_NewRef(value);
    Py_XDECREF(old);
}

/* *out = obj.<name> (new reference), or NULL without an error if it has none. 0, or -1 on error. */
static inline int
adb_optional_attr(PyObject *obj, const char *name, PyObject **out)
{
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttrString(obj, name, out) < 0 ? -1 : 0;
#else
    *out = PyObject_GetAttrString(obj, name);
    if (*out != NULL)
        return 0;
    if (!PyErr_ExceptionMatches(PyExc_AttributeError))
        return -1;
    PyErr_Clear();
    return 0;
#endif
}

/* The exception being raised, taken out of the thread state (a new reference, NULL if none). */
static inline PyObject *
adb_take_exception(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *typ, *val, *tb;
    PyErr_Fetch(&typ, &val, &tb);
    if (typ == NULL)
        return NULL;
    PyErr_NormalizeException(&typ, &val, &tb);
    if (tb != NULL && val != NULL)
        PyException_SetTraceback(val, tb);
    Py_XDECREF(typ);
    Py_XDECREF(tb);
    return val;
#endif
}

/* Raise `exc` (an exception instance; the reference is stolen). */
static inline void
adb_restore_exception(PyObject *exc)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

#endif /* ASYNCDBO_NATIVE_SLOTS_H */
