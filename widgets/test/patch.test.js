// Incremental redraws (patch.js): which keyed children a redraw keeps, updates, creates and removes; that an
// updated child keeps its element (and so focus) and that only what differs inside it is touched; that form
// controls go back to the view's values except the one being typed into.  The DOM here is a small fake with the
// few methods patch.js uses, and a parser for the tiny subset of HTML the tests write.
import { test } from "node:test";
import assert from "node:assert/strict";
import { forget, morph, patchChildren, planPatch, resetControls } from "../src/plan_canvas/patch.js";

class Node {
  constructor(nodeType, nodeName) {
    this.nodeType = nodeType;
    this.nodeName = nodeName;
    this.parentNode = null;
    this.childNodes = [];
  }
  get firstChild() { return this.childNodes[0] || null; }
  get nextSibling() {
    const s = this.parentNode ? this.parentNode.childNodes : [];
    return s[s.indexOf(this) + 1] || null;
  }
  get children() { return this.childNodes.filter((n) => n.nodeType === 1); }
  detach() {
    if (this.parentNode) this.parentNode.childNodes.splice(this.parentNode.childNodes.indexOf(this), 1);
    this.parentNode = null;
  }
  insertBefore(n, ref) {
    n.detach();
    const i = ref ? this.childNodes.indexOf(ref) : this.childNodes.length;
    assert.ok(i >= 0, "insertBefore: the reference is not a child");
    this.childNodes.splice(i, 0, n);
    n.parentNode = this;
    log.push(["insert", n.label()]);
    return n;
  }
  appendChild(n) { return this.insertBefore(n, null); }
  removeChild(n) {
    assert.equal(n.parentNode, this);
    n.detach();
    log.push(["remove", n.label()]);
    return n;
  }
  replaceChild(n, old) {
    this.insertBefore(n, old);
    this.removeChild(old);
  }
  label() { return this.nodeType === 3 ? `"${this.nodeValue}"` : this.attrs.get("id") || this.nodeName; }
}
class Text extends Node {
  constructor(text) { super(3, "#text"); this._v = text; }
  get nodeValue() { return this._v; }
  set nodeValue(v) { this._v = v; log.push(["text", v]); }
}
class Element extends Node {
  constructor(tag) { super(1, tag.toUpperCase()); this.tagName = tag.toUpperCase(); this.attrs = new Map(); }
  getAttributeNames() { return [...this.attrs.keys()]; }
  hasAttribute(n) { return this.attrs.has(n); }
  getAttribute(n) { return this.attrs.has(n) ? this.attrs.get(n) : null; }
  setAttribute(n, v) { this.attrs.set(n, String(v)); log.push(["set", this.label(), n]); }
  removeAttribute(n) { this.attrs.delete(n); log.push(["unset", this.label(), n]); }
  get textContent() { return this.childNodes.map((n) => (n.nodeType === 3 ? n.nodeValue : n.textContent)).join(""); }
  set textContent(v) {
    for (const n of [...this.childNodes]) n.detach();
    const t = new Text(v);
    t.parentNode = this;
    this.childNodes.push(t);
    log.push(["content", this.label(), v]);
  }
  querySelector(sel) {  // ".cls" only: the first descendant with that class
    for (const n of this.children) {
      if ((n.attrs.get("class") || "").split(" ").includes(sel.slice(1))) return n;
      const got = n.querySelector(sel);
      if (got) return got;
    }
    return null;
  }
}
let log = [];

// <tag a="v" ...>text or children</tag>, nothing else
function parse(html) {
  const root = new Element("fragment");
  const stack = [root];
  const re = /<(\/?)([a-z]+)((?:\s+[a-z-]+="[^"]*")*)\s*>|([^<]+)/g;
  let m;
  while ((m = re.exec(html))) {
    const top = stack[stack.length - 1];
    if (m[4] !== undefined) { const t = new Text(m[4]); t.parentNode = top; top.childNodes.push(t); continue; }
    if (m[1]) { stack.pop(); continue; }
    const el = new Element(m[2]);
    for (const a of m[3].matchAll(/([a-z-]+)="([^"]*)"/g)) el.attrs.set(a[1], a[2]);
    el.parentNode = top;
    top.childNodes.push(el);
    if (m[2] !== "input") stack.push(el);
  }
  return root;
}
const html = (el) => el.childNodes.map((n) => (n.nodeType === 3 ? n.nodeValue
  : `<${n.tagName.toLowerCase()}${[...n.attrs].map(([k, v]) => ` ${k}="${v}"`).join("")}>${n.tagName === "INPUT" ? "" : html(n) + `</${n.tagName.toLowerCase()}>`}`)).join("");

test("planPatch: keep the same strings, update the changed ones, create the new keys, remove the gone ones", () => {
  const prev = new Map([["a", "<b>1</b>"], ["b", "<b>2</b>"], ["c", "<b>3</b>"]]);
  const { ops, removed } = planPatch(prev, [["c", "<b>3</b>"], ["a", "<b>one</b>"], ["d", "<b>4</b>"]]);
  assert.deepEqual(ops.map((o) => [o.key, o.op]), [["c", "keep"], ["a", "update"], ["d", "create"]]);
  assert.deepEqual(removed, ["b"]);
  assert.throws(() => planPatch(new Map(), [["a", "<b></b>"], ["a", "<i></i>"]]), /key "a" is given twice/);
});

test("patchChildren: the first patch replaces what the container held; then only the changed children are touched", () => {
  const box = new Element("div");
  box.appendChild(new Text("stale"));
  patchChildren(box, [["x", `<p id="x">one</p>`], ["y", `<p id="y">two</p>`]], parse);
  assert.equal(html(box), `<p id="x">one</p><p id="y">two</p>`);
  const [x, y] = box.children;
  log = [];
  const ops = patchChildren(box, [["x", `<p id="x">one</p>`], ["y", `<p id="y" class="hot">two!</p>`]], parse);
  assert.deepEqual(ops.map((o) => o.op), ["keep", "update"]);
  assert.equal(html(box), `<p id="x">one</p><p id="y" class="hot">two!</p>`);
  assert.ok(box.children[0] === x && box.children[1] === y, "both elements kept: an update morphs in place");
  assert.deepEqual(log, [["set", "y", "class"], ["text", "two!"]]);
  forget(box);
  patchChildren(box, [["z", `<p id="z">three</p>`]], parse);
  assert.equal(html(box), `<p id="z">three</p>`);
});

test("patchChildren: reorders, inserts and removes by key, and a child whose tag changed is replaced", () => {
  const box = new Element("div");
  patchChildren(box, [["a", `<p id="a">A</p>`], ["b", `<p id="b">B</p>`], ["c", `<p id="c">C</p>`]], parse);
  const [a, b] = box.children;
  patchChildren(box, [["b", `<p id="b">B</p>`], ["n", `<i id="n">N</i>`], ["a", `<p id="a">A</p>`]], parse);
  assert.equal(html(box), `<p id="b">B</p><i id="n">N</i><p id="a">A</p>`);
  assert.ok(box.children[0] === b && box.children[2] === a);
  patchChildren(box, [["b", `<div id="b">B</div>`], ["a", `<p id="a">A</p>`]], parse);
  assert.equal(html(box), `<div id="b">B</div><p id="a">A</p>`);
  assert.notEqual(box.children[0], b);
  assert.throws(() => patchChildren(box, [["b", `<p id="b">B</p><p>two</p>`], ["a", `<p id="a">A</p>`]], parse), /each html must be exactly one element/);
});

test("morph: attributes set and removed, text nodes updated in place, unlike children replaced, extra ones dropped", () => {
  const el = parse(`<div id="t" class="a" title="old"><b>7</b> <span>x</span><i>gone</i></div>`).children[0];
  const b = el.children[0];
  log = [];
  morph(el, parse(`<div id="t" class="a b"><b>8</b> <em>y</em></div>`).children[0]);
  assert.equal(html({ childNodes: [el] }), `<div id="t" class="a b"><b>8</b> <em>y</em></div>`);
  assert.equal(el.children[0], b, "the same <b>, its text changed");
  assert.deepEqual(log.filter((l) => l[0] !== "insert" && l[0] !== "remove"), [["unset", "t", "title"], ["set", "t", "class"], ["text", "8"]]);
  morph(el, parse(`<div id="t" class="a b"><b>8</b> <em>y</em><u>new</u></div>`).children[0]);
  assert.equal(html({ childNodes: [el] }), `<div id="t" class="a b"><b>8</b> <em>y</em><u>new</u></div>`);
});

test("resetControls: every control back to its markup's value, except the one being typed into", () => {
  const input = (value, defaultValue, extra = {}) => ({ tagName: "INPUT", type: "text", value, defaultValue, ...extra });
  const refused = input("12", "10");
  const typing = input("3:", "", {});
  const box = { tagName: "INPUT", type: "checkbox", checked: true, defaultChecked: false };
  const opts = [{ defaultSelected: false }, { defaultSelected: true }];
  const select = { tagName: "SELECT", options: opts, selectedIndex: 0 };
  const none = { tagName: "SELECT", options: [{ defaultSelected: false }, { defaultSelected: false }], selectedIndex: 1 };
  resetControls([refused, typing, box, select, none], typing);
  assert.equal(refused.value, "10");
  assert.equal(typing.value, "3:");
  assert.equal(box.checked, false);
  assert.equal(select.selectedIndex, 1);
  assert.equal(none.selectedIndex, 0, "no option marked: the first, as the browser shows it");
});

test("patchChildren: live fields are written into the element, only where they differ, and again after a morph", () => {
  const box = new Element("div");
  const tile = `<div id="t"><span class="m"></span></div>`;
  patchChildren(box, [["t", tile, [["", "title", "needs 1 GiB"], [".m", "text", "1 GiB"]]]], parse);
  assert.equal(html(box), `<div id="t" title="needs 1 GiB"><span class="m">1 GiB</span></div>`);
  const t = box.children[0];
  log = [];
  const ops = patchChildren(box, [["t", tile, [["", "title", "needs 2 GiB"], [".m", "text", "1 GiB"]]]], parse);
  assert.deepEqual(ops.map((o) => o.op), ["keep"]);  // the markup is the same string: nothing parsed or morphed
  assert.deepEqual(log, [["set", "t", "title"]]);  // the one field that changed
  assert.ok(box.children[0] === t);
  patchChildren(box, [["t", `<div id="t" class="hot"><span class="m"></span></div>`, [["", "title", "needs 2 GiB"], [".m", "text", "2 GiB"]]]], parse);
  assert.equal(html(box), `<div id="t" class="hot" title="needs 2 GiB"><span class="m">2 GiB</span></div>`);  // the morph dropped them; written again
  assert.ok(box.children[0] === t);
  patchChildren(box, [["t", tile, [[".gone", "text", "x"]]]], parse);  // a selector that finds nothing is skipped
  assert.equal(html(box), `<div id="t"><span class="m"></span></div>`);
});
