package bench;

import io.confluent.parallelconsumer.ParallelConsumerOptions;
import io.confluent.parallelconsumer.ParallelConsumerOptions.CommitMode;
import io.confluent.parallelconsumer.ParallelConsumerOptions.ProcessingOrder;
import io.confluent.parallelconsumer.ParallelStreamProcessor;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.lang.management.ManagementFactory;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.atomic.AtomicLong;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

/**
 * Parallel Consumer with a no-op function, for bench/bench_system.py: consumes TOPIC with a
 * fresh GROUP until told to stop, and prints one JSON line when the first record was processed
 * and one when the N-th was (process CPU time and System.nanoTime at each).
 *
 * <pre>java -cp ... bench.PcBench BOOTSTRAP TOPIC GROUP N MAX_CONCURRENCY</pre>
 *
 * Reads "stop" (or EOF) on stdin, then closes the processor (its last commit) and exits.
 */
public final class PcBench {
  private PcBench() {}

  private static long cpuNanos() {
    return ((com.sun.management.OperatingSystemMXBean) ManagementFactory.getOperatingSystemMXBean())
        .getProcessCpuTime();
  }

  private static synchronized void say(String event, long count) {
    System.out.printf(
        "{\"event\": \"%s\", \"count\": %d, \"cpu_ns\": %d, \"nano\": %d}%n",
        event, count, cpuNanos(), System.nanoTime());
    System.out.flush();
  }

  public static void main(String[] args) throws Exception {
    String bootstrap = args[0];
    String topic = args[1];
    String group = args[2];
    long n = Long.parseLong(args[3]);
    int maxConcurrency = Integer.parseInt(args[4]);

    Properties props = new Properties();
    props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
    props.put(ConsumerConfig.GROUP_ID_CONFIG, group);
    props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
    props.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
    props.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
    props.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
    KafkaConsumer<byte[], byte[]> consumer = new KafkaConsumer<>(props);

    ParallelConsumerOptions<byte[], byte[]> options =
        ParallelConsumerOptions.<byte[], byte[]>builder()
            .ordering(ProcessingOrder.UNORDERED)
            .maxConcurrency(maxConcurrency)
            .commitMode(CommitMode.PERIODIC_CONSUMER_ASYNCHRONOUS)
            .consumer(consumer)
            .build();
    ParallelStreamProcessor<byte[], byte[]> processor =
        ParallelStreamProcessor.createEosStreamProcessor(options);
    processor.subscribe(List.of(topic));

    AtomicLong processed = new AtomicLong();
    processor.poll(
        context -> {
          long count = processed.incrementAndGet();
          if (count == 1) {
            say("first", count);
          } else if (count == n) {
            say("last", count);
          }
        });

    BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
    String line;
    while ((line = in.readLine()) != null && !line.trim().equals("stop")) {
      // wait
    }
    processor.close();
    say("closed", processed.get());
  }
}
