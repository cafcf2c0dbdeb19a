// Routing arrows through the gaps.
// Arrows run along channels: the gaps between tile rows and columns, the node margins and the gaps between
// nodes, so that they never hide a tile (nor cross one they do not connect).  Dijkstra over the channel
// crossings, with a penalty per turn.

import { GAP, PAD, HEAD, NODE_GAP, HULL } from "./constants.js";

// The channels of a layout: X and Y, the coordinates of the channel lines (sorted); ok[i][j], whether the crossing
// (X[i], Y[j]) lies off every tile; free(x0, y0, x1, y1), whether a segment crosses no tile (tiles grown by 1 px);
// right[i][j] and down[i][j], whether the step to the next crossing to the right / below stays free.
export function channels(lay) {
  const xs = new Set(), ys = new Set();
  for (const b of lay.boxes) {
    xs.add(b.x + PAD / 2); xs.add(b.x + b.w - PAD / 2);
    ys.add(b.y + HEAD + PAD / 2 - 2); ys.add(b.y + b.h - PAD / 2);
    xs.add(b.x - NODE_GAP / 2); xs.add(b.x + b.w + NODE_GAP / 2);
    ys.add(b.y - NODE_GAP / 2); ys.add(b.y + b.h + NODE_GAP / 2);
  }
  for (const t of lay.tiles) {
    if (!t) continue;
    if (t.col > 0) xs.add(t.x - GAP / 2);
    if (t.row > 0) ys.add(t.y - GAP / 2);
    // lines through each tile's centre: a route starts and ends straight above, below or beside a tile (it never
    // runs along them across a tile: only the free steps between crossings are taken)
    xs.add(t.x + t.w / 2);
    ys.add(t.y + t.h / 2);
  }
  const X = [...xs].filter((x) => x > -NODE_GAP / 2 && x < lay.width + NODE_GAP / 2).sort((a, b) => a - b);
  const Y = [...ys].filter((y) => y > -NODE_GAP / 2 && y < lay.height + NODE_GAP / 2).sort((a, b) => a - b);
  const rects = lay.tiles.filter(Boolean).map((t) => [t.x - 1, t.y - 1, t.x + t.w + 1, t.y + t.h + 1]);
  const free = (x0, y0, x1, y1) => !rects.some((r) => Math.max(x0, x1) > r[0] && Math.min(x0, x1) < r[2] && Math.max(y0, y1) > r[1] && Math.min(y0, y1) < r[3]);
  const ok = X.map((x) => Y.map((y) => free(x, y, x, y)));
  // which steps between neighbouring crossings stay in the gaps (computed once per layout, not per arrow)
  const right = X.map((x, i) => Y.map((y) => i + 1 < X.length && free(x, y, X[i + 1], y)));
  const down = X.map((x) => Y.map((y, j) => j + 1 < Y.length && free(x, y, x, Y[j + 1])));
  return { X, Y, ok, free, right, down };
}

// A binary min-heap of [cost, ...] entries.
export class Heap {
  constructor() { this.a = []; }
  get size() { return this.a.length; }
  push(e) {
    const a = this.a;
    a.push(e);
    for (let i = a.length - 1; i > 0;) {
      const p = (i - 1) >> 1;
      if (a[p][0] <= a[i][0]) break;
      [a[p], a[i]] = [a[i], a[p]];
      i = p;
    }
  }
  pop() {
    const a = this.a, top = a[0], last = a.pop();
    if (a.length) {
      a[0] = last;
      for (let i = 0; ;) {
        const l = 2 * i + 1, r = l + 1;
        let m = i;
        if (l < a.length && a[l][0] < a[m][0]) m = l;
        if (r < a.length && a[r][0] < a[m][0]) m = r;
        if (m === i) break;
        [a[m], a[i]] = [a[i], a[m]];
        i = m;
      }
    }
    return top;
  }
}

// The route from box src to box dst (boxes as geometry.bbox makes them) through the channels ch: a polyline
// [[x, y], ...] from a point on src's border to a point on dst's, each segment horizontal or vertical, collinear
// points dropped; null when no free crossing lies near src or dst (the caller then draws a straight line).
export function route(ch, src, dst) {
  const { X, Y, ok, free, right, down } = ch;
  const near = (b) => {
    const out = [];
    X.forEach((x, i) => Y.forEach((y, j) => {
      if (!ok[i][j]) return;
      const dx = x < b.x0 ? b.x0 - x : x > b.x1 ? x - b.x1 : 0, dy = y < b.y0 ? b.y0 - y : y > b.y1 ? y - b.y1 : 0;
      if ((dx === 0 || dy === 0) && dx + dy <= GAP + HULL + 2) {
        const p = [Math.min(Math.max(x, b.x0), b.x1), Math.min(Math.max(y, b.y0), b.y1)];
        if (free(p[0], p[1], x, y) || dx + dy <= HULL + 2) out.push({ i, j, p, d: dx + dy });
      }
    }));
    return out;
  };
  const starts = near(src), ends = near(dst);
  if (!starts.length || !ends.length) return null;
  const endAt = new Map(ends.map((e) => [`${e.i},${e.j}`, e]));
  const key = (i, j, d) => `${i},${j},${d}`;
  const dist = new Map(), prev = new Map(), heap = new Heap();
  const push = (c, i, j, d, from) => {
    const k = key(i, j, d);
    if (dist.has(k) && dist.get(k) <= c) return;
    dist.set(k, c); prev.set(k, from); heap.push([c, i, j, d]);
  };
  for (const s0 of starts) push(s0.d, s0.i, s0.j, -1, null);
  const steps = [[1, 0], [-1, 0], [0, 1], [0, -1]];
  let best = null;
  while (heap.size) {
    const [c, i, j, d] = heap.pop();
    if (c > dist.get(key(i, j, d))) continue;
    const e = endAt.get(`${i},${j}`);
    if (e && (!best || c + e.d < best.c)) best = { c: c + e.d, k: key(i, j, d), e };
    if (best && c > best.c) break;
    steps.forEach(([di, dj], nd) => {
      const ni = i + di, nj = j + dj;
      if (ni < 0 || nj < 0 || ni >= X.length || nj >= Y.length || !ok[ni][nj]) return;
      const open = di === 1 ? right[i][j] : di === -1 ? right[ni][j] : dj === 1 ? down[i][j] : down[i][nj];
      if (!open) return;
      const len = Math.abs(X[ni] - X[i]) + Math.abs(Y[nj] - Y[j]);
      push(c + len + (d >= 0 && d !== nd ? 40 : 0), ni, nj, nd, key(i, j, d));
    });
  }
  if (!best) return null;
  const pts = [];
  for (let k = best.k; k; k = prev.get(k)) {
    const [i, j] = k.split(",").map(Number);
    pts.push([X[i], Y[j]]);
  }
  pts.reverse();
  const s0 = starts.find((s) => s.i === X.indexOf(pts[0][0]) && s.j === Y.indexOf(pts[0][1]));
  if (s0) pts.unshift(s0.p);
  pts.push(best.e.p);
  // drop collinear points
  const out = [pts[0]];
  for (let k = 1; k < pts.length - 1; k++) {
    const [a, b, c] = [out[out.length - 1], pts[k], pts[k + 1]];
    if ((a[0] === b[0] && b[0] === c[0]) || (a[1] === b[1] && b[1] === c[1])) continue;
    out.push(b);
  }
  out.push(pts[pts.length - 1]);
  return out;
}

// The straight segments of a route, longest horizontal first (labels sit on them, inside a gap).
export function segments(pts) {
  const segs = [];
  for (let k = 0; k < pts.length - 1; k++) {
    const [a, b] = [pts[k], pts[k + 1]];
    segs.push({ a, b, len: Math.hypot(b[0] - a[0], b[1] - a[1]), horiz: a[1] === b[1] });
  }
  return segs.sort((p, q) => (q.horiz - p.horiz) * 1e6 + (q.len - p.len));
}

// A route's inner points moved by ((i % 5) - 2) * step on both axes (the ith of several arrows gets its own lane),
// its two ends kept where they are.
export function laneShift(pts, i, step) {
  const off = ((i % 5) - 2) * step;
  return pts.map(([x, y], k) => (k === 0 || k === pts.length - 1 ? [x, y] : [x + off, y + off]));
}
