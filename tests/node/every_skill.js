// The official Moondream Node client (npm moondream 0.2.0) calling every skill it has through the gateway; prints
// one JSON object of what it got. Usage: node every_skill.js <endpoint> <api key> <image file> <variant>
const fs = require("fs");
const { vl } = require("moondream");

async function collect(stream) {
  let text = "";
  for await (const chunk of stream) text += chunk;
  return text;
}

async function main() {
  const [endpoint, apiKey, imageFile, variant] = process.argv.slice(2);
  const model = new vl({ endpoint, apiKey });
  const image = fs.readFileSync(imageFile);
  const out = {};
  out.caption = (await model.caption({ image, length: "short" })).caption;
  out.captionStream = await collect((await model.caption({ image, length: "short", stream: true })).caption);
  out.query = (await model.query({ image, question: "What is this?" })).answer;
  out.queryStream = await collect((await model.query({ image, question: "What is this?", stream: true })).answer);
  out.detect = (await model.detect({ image, object: "cat" })).objects;
  out.point = (await model.point({ image, object: "cat" })).points;
  out.variantQuery = (await model.query({ image, question: "What is this?", variant })).answer;
  console.log(JSON.stringify(out));
}

main().catch((e) => { console.error(e); process.exit(1); });
