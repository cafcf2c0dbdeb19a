// Incremental redraws: a container's children described as keyed HTML strings ([key, html], one element each).
// A redraw re-parses only the children whose string changed and updates each of them in place (its attributes,
// then its children), so an element keeps its identity -- and with it focus, scroll and a typed value -- where a
// rebuild of the whole canvas (innerHTML) re-parsed, re-styled and re-laid out everything on every click.

// What a redraw does to a container's children: `ops` in the new order, each "keep" (the same string),
// "update" (the key is there, its string changed) or "create" (a new key); `removed`: the keys that went away.
// `prev`: Map key -> html of the last redraw; `next`: [[key, html], ...].
// A child may come with `fields` ([key, html, fields]): values written straight into its element (setFields).
export function planPatch(prev, next) {
  const seen = new Set();
  const ops = next.map(([key, html, fields]) => {
    if (seen.has(key)) throw new Error(`planPatch: the key ${JSON.stringify(key)} is given twice; every child needs its own key`);
    seen.add(key);
    const old = prev.get(key);
    return { key, html, fields, op: old === undefined ? "create" : old === html ? "keep" : "update" };
  });
  const removed = [...prev.keys()].filter((k) => !seen.has(k));
  return { ops, removed };
}

const STATE = new WeakMap();  // container -> Map key -> {html, el}

// Make `parent`'s children those of `next` ([[key, html]]), touching only what changed (see planPatch); the
// children's HTML is parsed in one go by `parse(html)` (an element whose `children` are the parsed elements, in
// order: a <template>'s content in the browser).  The first patch of a container replaces whatever it held.
// Returns the ops (for the caller's bookkeeping and the tests).
export function patchChildren(parent, next, parse) {
  let state = STATE.get(parent);
  if (!state) {
    state = new Map();
    STATE.set(parent, state);
    while (parent.firstChild) parent.removeChild(parent.firstChild);
  }
  const { ops, removed } = planPatch(new Map([...state].map(([k, v]) => [k, v.html])), next);
  for (const k of removed) {
    const { el } = state.get(k);
    if (el.parentNode === parent) parent.removeChild(el);
    state.delete(k);
  }
  const fresh = ops.filter((o) => o.op !== "keep");
  const made = fresh.length ? [...parse(fresh.map((o) => o.html).join("")).children] : [];
  if (made.length !== fresh.length) {
    throw new Error(`patchChildren: ${fresh.length} changed children gave ${made.length} elements; each html must be exactly one element`);
  }
  let cursor = parent.firstChild;
  let m = 0;
  for (const o of ops) {
    let el = o.op === "keep" ? state.get(o.key).el : null;
    if (o.op === "update") {
      el = state.get(o.key).el;
      const n = made[m++];
      if (el.tagName === n.tagName) morph(el, n);
      else { if (el === cursor) cursor = cursor.nextSibling; if (el.parentNode === parent) parent.removeChild(el); el = n; }
    } else if (o.op === "create") el = made[m++];
    if (el === cursor) cursor = cursor.nextSibling;
    else parent.insertBefore(el, cursor);
    state.set(o.key, { html: o.html, el });
    if (o.fields) setFields(el, o.fields);
  }
  while (cursor) {  // something else put there (never by the canvas): not ours to keep
    const after = cursor.nextSibling;
    parent.removeChild(cursor);
    cursor = after;
  }
  return ops;
}

// Live fields: values that change on most redraws while the markup around them stays (a tile's tooltip and
// memory figure, which every edit between a valid and an invalid plan changes on every tile).  A part keeps
// them out of its HTML string and lists them as [selector ("" for the element itself), name ("text" for its
// text, else an attribute), value]; `patchChildren` writes them after placing the element, touching only those
// that differ, so a part whose only change is such a value is neither re-parsed nor morphed.  (A morph drops
// attributes its new markup lacks; the fields are written again right after it.)
export function setFields(el, fields) {
  for (const [sel, name, value] of fields) {
    const t = sel ? el.querySelector(sel) : el;
    if (!t) continue;
    if (name === "text") {
      if (t.textContent !== value) t.textContent = value;
    } else if (t.getAttribute(name) !== value) t.setAttribute(name, value);
  }
}

// Forget what `patchChildren` knows of `parent` (its next patch starts afresh).
export function forget(parent) {
  STATE.delete(parent);
}

// Make `el` look like `n` (the same tag), touching only what differs: its attributes, then its children in
// order -- a child of the same kind and tag is morphed in turn (a text node takes the new text), any other is
// replaced by `n`'s (moved over), and the extra ones go.  A redraw where only some numbers changed thus changes
// only those text nodes, and the browser re-styles and re-lays out little.
export function morph(el, n) {
  const names = el.getAttributeNames();
  for (const name of names) if (!n.hasAttribute(name)) el.removeAttribute(name);
  for (const name of n.getAttributeNames()) {
    const v = n.getAttribute(name);
    if (el.getAttribute(name) !== v) el.setAttribute(name, v);
  }
  let a = el.firstChild;
  let b = n.firstChild;
  while (b) {
    const nextB = b.nextSibling;
    if (!a) el.appendChild(b);
    else if (a.nodeType !== b.nodeType || a.nodeName !== b.nodeName) {
      const nextA = a.nextSibling;
      el.replaceChild(b, a);
      a = nextA;
    } else {
      if (a.nodeType === ELEMENT) morph(a, b);
      else if (a.nodeValue !== b.nodeValue) a.nodeValue = b.nodeValue;
      a = a.nextSibling;
    }
    b = nextB;
  }
  while (a) {
    const nextA = a.nextSibling;
    el.removeChild(a);
    a = nextA;
  }
}

const ELEMENT = 1;

// Form controls show what the view says (their markup's value) after a redraw, as a rebuild did: a control that
// kept its element may hold a value the user changed that Python refused.  `keep`: the focused control whose
// typed text stays.
export function resetControls(controls, keep) {
  for (const c of controls) {
    if (c === keep) continue;
    if (c.tagName === "SELECT") {
      let want = 0;
      for (let i = 0; i < c.options.length; i++) if (c.options[i].defaultSelected) want = i;
      if (c.options.length && c.selectedIndex !== want) c.selectedIndex = want;
    } else if (c.type === "checkbox" || c.type === "radio") {
      if (c.checked !== c.defaultChecked) c.checked = c.defaultChecked;
    } else if (c.value !== c.defaultValue) c.value = c.defaultValue;
  }
}
