// Checks Prometheus Operator objects (a JSON array on stdin) two ways:
//
// 1. the JSON Schema validators of @kubernetes-models/prometheus-operator,
//    generated from the operator's Go API types (pkg/apis/monitoring): types,
//    required fields, enums and patterns (durations, ...);
// 2. TypeScript's excess-property check against the same package's types:
//    every object literal must use only fields the API defines (what
//    `kubectl apply --validate=strict` refuses as an unknown field) — the
//    schema validators in 1 accept unknown fields.
//
// Prints one line per problem; exit 1 if any. Run by tests/deploy/test_k8s.py
// after `npm ci` here.
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import ts from "typescript";
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";

const MODELS = { PodMonitor, PrometheusRule, ServiceMonitor };
const here = dirname(fileURLToPath(import.meta.url));
const objects = JSON.parse(readFileSync(0, "utf8"));
const problems = [];

// 1. JSON Schema.
for (const obj of objects) {
  const id = `${obj.kind}/${obj.metadata?.name}`;
  const Model = MODELS[obj.kind];
  if (obj.apiVersion !== "monitoring.coreos.com/v1" || !Model) {
    problems.push(`${id}: not a monitoring.coreos.com/v1 kind this check knows`);
    continue;
  }
  try {
    new Model(obj).validate();
  } catch (err) {
    problems.push(`${id}: ${err.message}`);
  }
}

// 2. Unknown fields.
const dir = mkdtempSync(join(here, ".check-"));
try {
  const file = join(dir, "objects.ts");
  const kinds = [...new Set(objects.map((o) => o.kind).filter((k) => k in MODELS))];
  const lines = kinds.map(
    (k) =>
      `import type { I${k} } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/${k}";`,
  );
  objects.forEach((obj, i) => {
    if (obj.kind in MODELS) {
      lines.push(`// ${obj.kind}/${obj.metadata?.name}`);
      lines.push(`export const o${i}: I${obj.kind} = ${JSON.stringify(obj, null, 1)};`);
    }
  });
  writeFileSync(file, lines.join("\n") + "\n");
  const program = ts.createProgram([file], {
    strict: true,
    noEmit: true,
    skipLibCheck: true,
    target: ts.ScriptTarget.ES2022,
    module: ts.ModuleKind.NodeNext,
    moduleResolution: ts.ModuleResolutionKind.NodeNext,
  });
  for (const d of ts.getPreEmitDiagnostics(program)) {
    const text = ts.flattenDiagnosticMessageText(d.messageText, "\n");
    let where = "";
    if (d.file && d.start !== undefined) {
      // The object a diagnostic falls in: the nearest `// Kind/name` above it.
      const before = d.file.text.slice(0, d.start).split("\n");
      where = before.reverse().find((l) => l.startsWith("// ")) ?? "";
      where = where.slice(3) + ": ";
    }
    problems.push(`${where}${text}`);
  }
} finally {
  rmSync(dir, { recursive: true, force: true });
}

for (const p of problems) console.log(p);
if (problems.length === 0) console.log(`ok: ${objects.length} objects`);
process.exit(problems.length ? 1 : 0);
