// Builds the widgets' front ends: each entry under src/ bundled by esbuild into one ES module that the Python
// package ships (hspmd_sdk/viz/static/, loaded as the anywidget's _esm).  Not minified, deterministic: the same
// sources give the same bytes (tests/test_widgets.py rebuilds into a temporary folder and compares).
//
//   node build.mjs                 write the bundles into hspmd_sdk/viz/static/ (npm run build)
//   node build.mjs --outdir DIR    write them into DIR instead
import { build } from "esbuild";
import { mkdirSync } from "node:fs";
import { dirname, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const ENTRIES = { plan_canvas: "src/plan_canvas/index.js", job_dashboard: "src/job_dashboard/index.js" };
const BANNER = "// GENERATED FILE: do not edit. Built from widgets/src by `npm run build` (esbuild) in widgets/.";

function outdirOf(argv) {
  const i = argv.findIndex((a) => a === "--outdir" || a.startsWith("--outdir="));
  if (i < 0) return resolve(here, "..", "hspmd_sdk", "viz", "static");
  const v = argv[i].includes("=") ? argv[i].slice("--outdir=".length) : argv[i + 1];
  if (!v) throw new Error("--outdir needs a folder");
  return resolve(process.cwd(), v);
}

const outdir = outdirOf(process.argv.slice(2));
mkdirSync(outdir, { recursive: true });
for (const [name, entry] of Object.entries(ENTRIES)) {
  await build({
    absWorkingDir: here,
    entryPoints: [entry],
    outfile: resolve(outdir, `${name}.js`),
    bundle: true,
    format: "esm",
    platform: "browser",
    target: "es2020",
    minify: false,
    sourcemap: false,
    charset: "utf8",
    legalComments: "none",
    banner: { js: BANNER },
    logLevel: "warning",
  });
  console.log(`${name}.js -> ${resolve(outdir, `${name}.js`)}`);
}
