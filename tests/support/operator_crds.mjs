// Validates Prometheus operator objects (JSON list on stdin) with the real monitoring.coreos.com/v1
// CRD schemas, as @kubernetes-models/prometheus-operator ships them (compiled from the operator's CRDs).
// argv[2]: the node_modules folder holding that package (./dev.sh test installs it into .tools/node).
// Prints one line per invalid object ("Kind/name: errors"); exit 1 if any.
import { pathToFileURL } from "node:url";
import path from "node:path";
import fs from "node:fs";

const modules = process.argv[2];
const docs = JSON.parse(fs.readFileSync(0, "utf8"));
let failed = 0;
for (const doc of docs) {
  const file = path.join(modules, "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1", `${doc.kind}.js`);
  const model = (await import(pathToFileURL(file).href))[doc.kind];
  try {
    new model(doc).validate();
  } catch (error) {
    failed++;
    console.log(`${doc.kind}/${doc.metadata.name}: ${error.message}`);
  }
}
process.exit(failed ? 1 : 0);
